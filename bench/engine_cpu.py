"""Engine vs Hugging Face ``generate`` on the CPU: prefill and decode tokens/s, batch 1 and 8.

Both run the embedded SmolLM2-135M GGUF in float32, in this process, on the same prompts of
equal length (no padding for Hugging Face), greedy, with the same torch thread count.
Prefill time is the time to the first token; decode tokens/s is
``batch * (new_tokens - 1) / (time for new_tokens - time to the first token)``.

    python bench/engine_cpu.py [--prompt-len 256] [--new-tokens 32] [--threads 1] [--repeats 2]

Writes ``bench/results/engine_cpu-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import embedded_model_path, load_checkpoint
from infinite_llm.engine.sampling import SamplingParams


def _prompts(tokenizer, batch: int, length: int) -> list[list[int]]:
    prompts = []
    for i in range(batch):
        text = " ".join(f"Note {i}.{j}: the sample {j * 7 + i} weighed {j * 13 % 97} grams." for j in range(200))
        ids = tokenizer.encode(text)
        if len(ids) < length:
            raise ValueError(f"prompt {i} has only {len(ids)} tokens")
        prompts.append(ids[:length])
    return prompts


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine_cpu-cpu.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    checkpoint = load_checkpoint(None, show_progress=False)
    path = embedded_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    hf.eval()
    engine = LLMEngine(checkpoint, EngineConfig(pool_blocks=(2048,), max_num_seqs=16, max_num_batched_tokens=2048))

    def run_engine(prompts, n):
        engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))

    def run_hf(prompts, n):
        with torch.no_grad():
            hf.generate(torch.tensor(prompts), attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
                        max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=2)

    rows = []
    for batch in args.batches:
        prompts = _prompts(checkpoint.tokenizer, batch, args.prompt_len)
        row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        for name, run in (("engine", run_engine), ("hf", run_hf)):
            run(prompts, 2)  # warm-up
            first = _best(lambda: run(prompts, 1), args.repeats)
            total = _best(lambda: run(prompts, args.new_tokens), args.repeats)
            row[f"{name}_prefill_tok_s"] = batch * args.prompt_len / first
            row[f"{name}_decode_tok_s"] = batch * (args.new_tokens - 1) / max(total - first, 1e-9)
        row["prefill_ratio"] = row["engine_prefill_tok_s"] / row["hf_prefill_tok_s"]
        row["decode_ratio"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
        rows.append(row)

    result = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": path.name,
        "dtype": "float32",
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'batch':>5} {'engine prefill':>15} {'hf prefill':>11} {'ratio':>6} {'engine decode':>14} {'hf decode':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['batch']:>5} {r['engine_prefill_tok_s']:>15.1f} {r['hf_prefill_tok_s']:>11.1f} {r['prefill_ratio']:>6.2f} "
              f"{r['engine_decode_tok_s']:>14.1f} {r['hf_decode_tok_s']:>10.1f} {r['decode_ratio']:>6.2f}")


if __name__ == "__main__":
    main()
