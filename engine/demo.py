"""``make run``: the embedded model answers a long prompt whose KV spills over in-process pools.

    python -m infinite_llm.engine.demo [--model PATH] [--prompt-file FILE] [--max-tokens N]

The home pool is too small for the prompt, so as the prompt is prefilled in chunks the engine
lends its oldest blocks to three creditor pools; every layer then attends over all four and
merges. The answer streams as it is made, then the placement of the request's KV is printed.
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import EngineConfig
from .engine import LLMEngine
from .sampling import SamplingParams


def _long_document() -> str:
    planets = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
    lines = ["Here is the logbook of a space station. Read it, then answer the question after it."]
    for day in range(1, 121):
        planet = planets[(day * 5) % len(planets)]
        lines.append(f"Day {day}: the crew observed {planet}; the pump pressure read {100 + day * 3 % 17} kPa.")
    lines.append("Day 121: the crew repaired the antenna and sent a message home.")
    lines.append("\nQuestion: what did the crew do on day 121? Answer in one sentence.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a .gguf file or Hugging Face folder (default: embedded SmolLM2-135M)")
    parser.add_argument("--prompt-file", help="read the user message from this file")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--home-blocks", type=int, default=40, help="blocks of 16 tokens in the home pool")
    parser.add_argument("--creditor-blocks", type=int, nargs="+", default=[48, 64, 96])
    args = parser.parse_args(argv)

    config = EngineConfig(block_size=16, pool_blocks=(args.home_blocks, *args.creditor_blocks),
                          max_num_batched_tokens=256)
    print("loading the model ...", file=sys.stderr)
    engine = LLMEngine.from_path(args.model, config)
    question = open(args.prompt_file).read() if args.prompt_file else _long_document()
    prompt_ids = engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template([{"role": "user", "content": question}]), add_special_tokens=False
    )
    print(f"prompt: {len(prompt_ids)} tokens; pools (blocks of {config.block_size} tokens): "
          + ", ".join(f"instance {i}: {n}" for i, n in enumerate(config.pool_blocks)) + "\n")
    request_id = engine.add_request(prompt_ids, SamplingParams(max_tokens=args.max_tokens))
    start = time.perf_counter()
    placement = ()
    num_tokens = 0
    while engine.has_unfinished:
        for output in engine.step():
            print(output.new_text, end="", flush=True)
            num_tokens += len(output.new_token_ids)
        if engine.scheduler.requests.get(request_id):
            placement = engine.placement(request_id)
    elapsed = time.perf_counter() - start
    print(f"\n\n{num_tokens} tokens in {elapsed:.1f} s. Where the request's KV lived at its last step:")
    for segment in placement:
        role = "home" if segment.instance_id == engine.home_instance_id else "creditor"
        print(f"  tokens [{segment.token_start:5d}, {segment.token_end:5d}) on instance {segment.instance_id} "
              f"({role}), blocks {_ranges(segment.block_ids)}")
    return 0


def _ranges(ids: tuple[int, ...]) -> str:
    """``(0, 1, 2, 7)`` -> ``"0-2, 7"``."""
    parts = []
    start = prev = ids[0]
    for i in ids[1:] + (None,):
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)


if __name__ == "__main__":
    raise SystemExit(main())
