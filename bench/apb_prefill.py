"""Prefill of one long prompt over P GPUs: APB against exact prefill on one GPU and against ring
(zigzag RingAttention) prefill on the same P GPUs, all measured in one run.

One process per GPU; a Llama-3-8B-shaped model with random bf16 weights (the same on every
GPU); attention through the flash kernels for all three (``engine/seq_parallel.py``). Times
are of the whole prefill of the document (every layer, no logits), slowest host, best of
``--repeats`` runs, after a warm-up at a short length. Also reported: how far APB's and ring's last hidden state is from
exact prefill's (ring: rounding; APB: its approximation, on random weights).

    python bench/apb_prefill.py                                # 131072 tokens over every GPU
    python bench/apb_prefill.py --tokens 32768,131072 --anchor 4096 --passing 2048
    python bench/apb_prefill.py --device cpu --world 2 --tokens 512 --shape tiny   # smoke run

Writes ``bench/results/apb_prefill-<gpu>-x<world>.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import time
from pathlib import Path

from infinite_llm.bench.workers import add_worker_arguments, run_workers  # noqa: E402  (before torch)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from infinite_llm.bench.engine_gpu import LLAMA3_8B, TINY, llama_config, random_weights  # noqa: E402
from infinite_llm.engine.model import LlamaModel  # noqa: E402
from infinite_llm.engine.seq_parallel import (  # noqa: E402
    APBConfig,
    TorchHostGroup,
    apb_prefill,
    exact_prefill,
    ring_prefill,
)

QUERY_LEN = 64
WARMUP_TOKENS = 4096


def timed(device: torch.device, fn, repeats: int, together: bool = True) -> tuple[float, object]:
    """Best of ``repeats`` runs of ``fn``; with ``together``, every host runs it and the slowest
    host's time counts (it ends the prefill)."""
    best, result = float("inf"), None
    for _ in range(repeats):
        result = None  # free the last run's KV before the next
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if together:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=device)
        if together:
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        best = min(best, float(elapsed))
    return best, result


def worker(ns: argparse.Namespace, rank: int) -> None:
    if ns.device == "cuda":
        torch.cuda.set_device(rank)
        device, backend, dtype = torch.device("cuda", rank), "nccl", torch.bfloat16
    else:
        device, backend, dtype = torch.device("cpu"), "gloo", torch.float32
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{ns.port}", rank=rank, world_size=ns.world,
                            device_id=device if device.type == "cuda" else None)
    size = ns.world
    shape = LLAMA3_8B if ns.shape == "llama3-8b" else TINY
    lengths = [int(t) for t in ns.tokens.split(",")]
    config = llama_config(shape, max(lengths) + QUERY_LEN)
    torch.manual_seed(0)  # the same weights on every host
    model = LlamaModel(config, random_weights(config, device, dtype), device=device, dtype=dtype)
    group = TorchHostGroup()
    rows = []
    # On the GPU a short warm-up first (kernel compilation, NCCL connections), not reported.
    plan = ([(True, min(WARMUP_TOKENS, lengths[0]))] if device.type == "cuda" else []) + [(False, n) for n in lengths]
    for warmup, length in plan:
        generator = torch.Generator().manual_seed(length)
        prompt = torch.randint(0, config.vocab_size, (length,), generator=generator)
        query = torch.randint(0, config.vocab_size, (QUERY_LEN,), generator=generator)
        chunk = length // size
        apb = APBConfig(anchor_len=min(ns.anchor, chunk), passing_len=ns.passing)
        loop = asyncio.new_event_loop()

        repeats = 1 if warmup else ns.repeats
        exact_s, exact = (None, None)
        if rank == 0 and not ns.no_exact:
            exact_s, exact = timed(device, lambda: loop.run_until_complete(exact_prefill(model, prompt)), repeats,
                                   together=False)
            exact.kv.clear()  # only its hidden states are compared
        ring_s, ring = timed(device, lambda: loop.run_until_complete(ring_prefill(model, group, prompt)), repeats)
        ring.kv.clear()
        apb_s, host = timed(device, lambda: loop.run_until_complete(
            apb_prefill(model, group, prompt[rank * chunk:(rank + 1) * chunk], prompt[:apb.anchor_len], query, apb)),
            repeats)
        # The last row of the document: where ring and APB hold it, against exact prefill.
        last = length - 1
        diffs = {}
        for name, result in (("ring", ring), ("apb", host)):
            hit = (result.positions == last).nonzero()
            # [holds the row (1.0 or 0.0), the row]: one all-gather tells who holds it.
            row = torch.zeros(1 + config.hidden_size, device=device)
            if hit.numel():
                row[0] = 1.0
                row[1:] = result.hidden[hit[0, 0]].float()
            gathered = [torch.empty_like(row) for _ in range(size)]
            dist.all_gather(gathered, row)
            if exact is not None:
                ref = exact.hidden[last].float()
                got = next(g[1:] for g in gathered if g[0] == 1.0)
                diffs[name] = {"max_abs": float((got - ref).abs().max()),
                               "cosine": float(torch.nn.functional.cosine_similarity(got, ref, dim=0))}
        del ring, host, exact
        if device.type == "cuda":
            torch.cuda.empty_cache()
        loop.close()
        if rank == 0:
            row = {"tokens": length, "hosts": size, "anchor_len": apb.anchor_len, "passing_len": apb.passing_len,
                   "query_len": QUERY_LEN, "exact_one_gpu_s": exact_s, "ring_s": ring_s, "apb_s": apb_s,
                   "last_row_vs_exact": diffs, "warmup": warmup}
            if exact_s:
                row["speedup_apb_over_exact"] = exact_s / apb_s
                row["speedup_ring_over_exact"] = exact_s / ring_s
            row["speedup_apb_over_ring"] = ring_s / apb_s
            rows.append(row)
            print(json.dumps(row), flush=True)
    if rank == 0:
        Path(ns.rows_out).write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--world", type=int, default=0, help="hosts (GPUs); default every GPU")
    parser.add_argument("--tokens", default="131072", help="document lengths, comma-separated")
    parser.add_argument("--shape", choices=["llama3-8b", "tiny"], default="llama3-8b")
    parser.add_argument("--anchor", type=int, default=4096, help="APB anchor block, tokens")
    parser.add_argument("--passing", type=int, default=2048, help="APB passing block per host and KV head, tokens")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each method; the best counts")
    parser.add_argument("--no-exact", action="store_true", help="skip exact prefill on one GPU (memory)")
    parser.add_argument("--out", default="")
    add_worker_arguments(parser)
    ns = parser.parse_args()
    ns.world = ns.world or (torch.cuda.device_count() if ns.device == "cuda" else 2)
    for length in (int(t) for t in ns.tokens.split(",")):
        if length % (2 * ns.world):
            sys.exit(f"--tokens {length} must be a multiple of 2 * hosts ({2 * ns.world})")
    if ns.world < 2:
        sys.exit("--world must be at least 2")
    if ns.worker_rank >= 0:
        worker(ns, ns.worker_rank)
        return

    rows = [r for r in run_workers(__file__, ns.world) if not r.pop("warmup")]
    name = torch.cuda.get_device_name(0).replace(" ", "-") if ns.device == "cuda" else "cpu"
    result = {"bench": "apb_prefill", "device": name, "world": ns.world, "host": platform.node(),
              "torch": torch.__version__, "shape": ns.shape, "dtype": "bfloat16" if ns.device == "cuda" else "float32",
              "unit": "seconds of the whole document prefill, slowest host", "rows": rows}
    out = Path(ns.out or Path(__file__).parent / "results" / f"apb_prefill-{name}-x{ns.world}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'tokens':>8} {'hosts':>5} {'exact 1 GPU':>11} {'ring':>8} {'APB':>8} {'APB/exact':>9} {'APB/ring':>8}")
    for r in rows:
        exact = f"{r['exact_one_gpu_s']:11.2f}" if r["exact_one_gpu_s"] else f"{'-':>11}"
        speedup = f"{r['speedup_apb_over_exact']:9.2f}" if r.get("speedup_apb_over_exact") else f"{'-':>9}"
        print(f"{r['tokens']:>8} {r['hosts']:>5} {exact} {r['ring_s']:8.2f} {r['apb_s']:8.2f} {speedup} "
              f"{r['speedup_apb_over_ring']:8.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
