"""Engine vs Hugging Face ``generate`` on the CPU: prefill and decode tokens/s, batch 1 and 8.

Both run the embedded SmolLM2-135M GGUF in float32, in this process, on the same prompts of
equal length (no padding for Hugging Face), greedy, with the same torch thread count.
Prefill time is the time to the first token; decode tokens/s is
``batch * (new_tokens - 1) / (time for new_tokens - time to the first token)``.

The machine may be shared, so the two sides are timed in alternation, ``--rounds`` times, and
each keeps its fastest time (load only ever adds time). The same run times the floor of a decode
step: the model's weight matmuls alone (every projection and the logits of ``batch`` rows, no
attention, norms or Python, on the engine's matmul kernels: MKL for one or two rows, oneDNN for
more), which no engine on these kernels can beat. The load average is recorded before and after.

    python bench/engine_cpu.py [--prompt-len 256] [--new-tokens 32] [--threads 1] [--rounds 5]

Writes ``bench/results/engine_cpu-cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import embedded_model_path, load_checkpoint
from infinite_llm.engine.model import LlamaModel
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


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_matmul_floor(model: LlamaModel, batch: int, repeats: int = 3) -> float:
    """Seconds of one decode step's weight matmuls alone: ``batch`` rows through every layer's
    projections and the logits, in the weight layout and with the matmul kernel the engine uses
    for that many rows (weights read from memory once each, as in a real step)."""
    c = model.config
    x = torch.randn(batch, c.hidden_size, dtype=model.dtype)
    mlp_in = torch.randn(batch, c.intermediate_size, dtype=model.dtype)
    layers = [model.weights_for(layer, batch) for layer in range(c.num_layers)]
    lm_head = model.lm_head_for(batch)

    def step() -> None:
        for w in layers:
            model.linear(x, w["qkv_proj"])
            model.linear(x, w["o_proj"])
            model.linear(x, w["gate_up_proj"])
            model.linear(mlp_in, w["down_proj"])
        model.linear(x, lm_head)

    step()
    return min(_seconds(step) for _ in range(repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5, help="alternations of engine and Hugging Face runs")
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

    load_before = os.getloadavg()
    rows = []
    for batch in args.batches:
        prompts = _prompts(checkpoint.tokenizer, batch, args.prompt_len)
        row = {"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens}
        sides = (("engine", run_engine), ("hf", run_hf))
        for _, run in sides:
            run(prompts, 2)  # warm-up
        # side -> [times to the first token], [times for all new tokens], one per round
        first: dict[str, list[float]] = {name: [] for name, _ in sides}
        total: dict[str, list[float]] = {name: [] for name, _ in sides}
        floor = []
        for _ in range(args.rounds):
            for name, run in sides:
                first[name].append(_seconds(lambda: run(prompts, 1)))
                total[name].append(_seconds(lambda: run(prompts, args.new_tokens)))
            floor.append(weight_matmul_floor(engine.model, batch))
        for name, _ in sides:
            best_first, best_total = min(first[name]), min(total[name])
            row[f"{name}_prefill_tok_s"] = batch * args.prompt_len / best_first
            row[f"{name}_decode_tok_s"] = batch * (args.new_tokens - 1) / max(best_total - best_first, 1e-9)
            row[f"{name}_decode_step_ms"] = (best_total - best_first) / (args.new_tokens - 1) * 1e3
        row["prefill_ratio"] = row["engine_prefill_tok_s"] / row["hf_prefill_tok_s"]
        row["decode_ratio"] = row["engine_decode_tok_s"] / row["hf_decode_tok_s"]
        row["weight_matmul_floor_ms"] = min(floor) * 1e3
        # The most any engine could reach against Hugging Face here: its step at the floor.
        row["decode_ratio_at_floor"] = row["hf_decode_step_ms"] / row["weight_matmul_floor_ms"]
        rows.append(row)

    result = {
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": path.name,
        "dtype": "float32",
        "rounds": args.rounds,
        "load_average_1_5_15_min": {"before": list(load_before), "after": list(os.getloadavg())},
        "cpu_count": os.cpu_count(),
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"load average before {load_before}, after {os.getloadavg()}")
    print(f"{'batch':>5} {'engine prefill':>15} {'hf prefill':>11} {'ratio':>6} {'engine decode':>14} {'hf decode':>10} {'ratio':>6}"
          f" {'floor ms':>9} {'hf ms':>7} {'engine ms':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['engine_prefill_tok_s']:>15.1f} {r['hf_prefill_tok_s']:>11.1f} {r['prefill_ratio']:>6.2f} "
              f"{r['engine_decode_tok_s']:>14.1f} {r['hf_decode_tok_s']:>10.1f} {r['decode_ratio']:>6.2f}"
              f" {r['weight_matmul_floor_ms']:>9.1f} {r['hf_decode_step_ms']:>7.1f} {r['engine_decode_step_ms']:>10.1f}")


if __name__ == "__main__":
    main()
