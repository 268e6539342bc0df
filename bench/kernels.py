"""Decode attention: MicroAttention over paged KV against torch SDPA and a device copy.

Measures, side by side in one run (see ``docs/performance.md``):

* ``micro_attention`` decode bandwidth (K and V bytes read once / time) against
  ``scaled_dot_product_attention(enable_gqa=True)`` on contiguous KV of the same values and
  against a device-to-device copy (bytes read + written / time);
* the cost of returning the log-sum-exp (against the output alone);
* ``merge_attention_states`` time as a fraction of the MicroAttention time it merges;
* one request cut into P shards (P kernels, or one batched kernel) plus the merge, against
  one kernel over the whole request.

Times are medians of CUDA-graph replays (``do_bench_cudagraph``): the engine replays decode
steps as graphs, so launch overheads of the Python wrappers are not what a step pays.
On a machine without CUDA it runs the torch paths on tiny shapes (a smoke run).

Usage: ``python bench/kernels.py [--sweep] [--shapes 1x32768,8x32768] [--block-sizes 16,64]``
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from infinite_llm.kernels import (
    MicroAttentionConfig,
    choose_num_splits,
    merge_attention_states,
    plan_micro_attention,
    run_micro_attention,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
NUM_LAYERS = 2  # a second layer puts real gaps between one layer's blocks
GPU_SHAPES = ["1x32768", "1x131072", "1x524288", "8x32768", "8x131072", "32x32768", "64x8192"]
CPU_SHAPES = ["1x2048", "4x1024"]
SHARD_COUNTS = [2, 4, 8, 16]


def parse_shape(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


class Timer:
    """Median time of a callable in ms: CUDA-graph replays on the GPU, wall clock on the CPU."""

    def __init__(self, device: torch.device, use_graphs: bool) -> None:
        self.device = device
        self.use_graphs = use_graphs and device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.device.type == "cuda":
            import triton.testing

            if self.use_graphs:
                return triton.testing.do_bench_cudagraph(fn, rep=25, return_mode="median")
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def copy_bandwidth(device: torch.device, timer: Timer, num_bytes: int) -> float:
    """Device-to-device (or host memcpy) bandwidth in GB/s, bytes read + written."""
    src = torch.randn(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = min(timer(lambda: dst.copy_(src)), Timer(device, use_graphs=False)(lambda: dst.copy_(src)))
    del src, dst
    return 2 * num_bytes / ms / 1e6


class DecodeCase:
    """One batch x context decode problem on a paged pool, with its contiguous twin for SDPA."""

    def __init__(self, batch: int, context: int, block_size: int, device: torch.device, dtype: torch.dtype):
        self.batch, self.context, self.block_size = batch, context, block_size
        blocks_per_seq = math.ceil(context / block_size)
        num_blocks = batch * blocks_per_seq
        gen = torch.Generator(device="cpu").manual_seed(batch * 1_000_003 + context + block_size)
        self.kv_pool = torch.randn(
            (num_blocks, NUM_LAYERS, 2, block_size, NUM_KV_HEADS, HEAD_DIM), dtype=dtype, device=device
        )
        # Scattered block ids: a paged pool after many allocations and frees.
        perm = torch.randperm(num_blocks, generator=gen).to(torch.int32)
        self.block_tables = perm.view(batch, blocks_per_seq).to(device)
        self.kv_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=device)
        self.q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device=device)
        self.layer = 1
        # Contiguous K, V [batch, num_kv_heads, context, head_dim] holding the same values.
        kv = self.kv_pool[self.block_tables.long(), self.layer]  # [B, blocks, 2, bs, Hkv, D]
        self.k = kv[:, :, 0].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
        self.v = kv[:, :, 1].reshape(batch, -1, NUM_KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2).contiguous()
        del kv
        self.kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * self.kv_pool.element_size()

    def plan(self, **kw):
        return plan_micro_attention(
            self.block_tables, self.kv_lens, self.query_start_loc,
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            block_size=self.block_size, num_blocks=self.kv_pool.shape[0],
            max_query_len=1, max_kv_len=self.context, check_bounds=False, **kw,
        )

    def sdpa(self) -> torch.Tensor:
        return F.scaled_dot_product_attention(self.q.unsqueeze(2), self.k, self.v, enable_gqa=True)

    def shard_plans(self, num_shards: int):
        """P plans, shard i holding a contiguous run of every sequence's blocks."""
        blocks_per_seq = self.block_tables.shape[1]
        per_shard = math.ceil(blocks_per_seq / num_shards)
        plans = []
        for shard in range(num_shards):
            lo = shard * per_shard
            hi = min(blocks_per_seq, lo + per_shard)
            if hi <= lo:
                continue
            tables = self.block_tables[:, lo:hi].contiguous()
            lens = torch.full_like(self.kv_lens, min(self.context, hi * self.block_size) - lo * self.block_size)
            plans.append(
                plan_micro_attention(
                    tables, lens, self.query_start_loc,
                    num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
                    block_size=self.block_size, num_blocks=self.kv_pool.shape[0],
                    max_query_len=1, max_kv_len=int(lens[0]), check_bounds=False,
                )
            )
        return plans

    def batched_shard_plan(self, num_shards: int):
        """One plan holding the P shards of every sequence as P * batch sequences."""
        blocks_per_seq = self.block_tables.shape[1]
        per_shard = math.ceil(blocks_per_seq / num_shards)
        tables = torch.zeros(num_shards * self.batch, per_shard, dtype=torch.int32, device=self.q.device)
        lens = torch.zeros(num_shards * self.batch, dtype=torch.int32)
        for shard in range(num_shards):
            lo = shard * per_shard
            hi = min(blocks_per_seq, lo + per_shard)
            rows = slice(shard * self.batch, (shard + 1) * self.batch)
            if hi > lo:
                tables[rows, : hi - lo] = self.block_tables[:, lo:hi]
                lens[rows] = min(self.context, hi * self.block_size) - lo * self.block_size
        lens = lens.to(self.q.device)
        qsl = torch.arange(num_shards * self.batch + 1, dtype=torch.int32, device=self.q.device)
        return plan_micro_attention(
            tables, lens, qsl,
            num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM,
            block_size=self.block_size, num_blocks=self.kv_pool.shape[0],
            max_query_len=1, max_kv_len=per_shard * self.block_size, check_bounds=False,
        )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def sweep_configs(case: DecodeCase, timer: Timer, num_sms: int) -> list[dict]:
    """Time MicroAttention under every candidate config and split density."""
    rows = []
    for tile_n in (32, 64, 128, 256):
        for num_warps in (4, 8):
            for num_stages in (2, 3, 4):
                cfg = MicroAttentionConfig(tile_n=tile_n, rows_per_program=16, num_warps=num_warps, num_stages=num_stages)
                max_tiles = math.ceil(case.context / tile_n)
                for programs_per_sm in (2, 4, 8, 16, 32):
                    splits, _ = choose_num_splits(case.batch * NUM_KV_HEADS, max_tiles, num_sms, programs_per_sm=programs_per_sm)
                    plan = case.plan(config=cfg, num_splits=splits)
                    row = {"tile_n": tile_n, "num_warps": num_warps, "num_stages": num_stages,
                           "programs_per_sm": programs_per_sm, "num_splits": splits}
                    try:
                        ms = timer(lambda: run_micro_attention(plan, case.q, case.kv_pool, case.layer))
                    except Exception as exc:  # a config that does not compile (shared memory) is skipped
                        row["error"] = str(exc).splitlines()[0][:200]
                        rows.append(row)
                        break
                    row.update(ms=ms, gbps=case.kv_bytes / ms / 1e6)
                    rows.append(row)
    ranked = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    for r in ranked[:5]:
        print(f"   sweep {case.batch}x{case.context} bs={case.block_size}: tile_n={r['tile_n']} warps={r['num_warps']} "
              f"stages={r['num_stages']} pps={r['programs_per_sm']} splits={r['num_splits']} {r['gbps']:.0f} GB/s", flush=True)
    return rows


def measure_case(case: DecodeCase, timer: Timer, copy_gbps: float, sweep: bool, num_sms: int) -> dict:
    if sweep:
        return {"batch": case.batch, "context": case.context, "block_size": case.block_size,
                "kv_bytes": case.kv_bytes, "sweep": sweep_configs(case, timer, num_sms)}
    plan = case.plan()
    state = run_micro_attention(plan, case.q, case.kv_pool, case.layer)
    ref = case.sdpa().squeeze(2)
    err = rel_error(state.out, ref)

    t_sdpa = timer(case.sdpa)
    t_micro = timer(lambda: run_micro_attention(plan, case.q, case.kv_pool, case.layer))
    t_micro_out_only = timer(lambda: run_micro_attention(plan, case.q, case.kv_pool, case.layer, return_lse=False))
    gbps = case.kv_bytes / t_micro / 1e6
    result = {
        "batch": case.batch,
        "context": case.context,
        "block_size": case.block_size,
        "num_splits": plan.num_splits,
        "tile_n": plan.config.tile_n,
        "kv_bytes": case.kv_bytes,
        "rel_error_vs_sdpa": err,
        "sdpa_ms": t_sdpa,
        "micro_ms": t_micro,
        "micro_out_only_ms": t_micro_out_only,
        "sdpa_gbps": case.kv_bytes / t_sdpa / 1e6,
        "micro_gbps": gbps,
        "micro_vs_sdpa": t_sdpa / t_micro,
        "micro_vs_copy": gbps / copy_gbps,
        "lse_cost": t_micro / t_micro_out_only - 1.0,
        "merge": [],
        "shards": [],
    }
    for num_parts in SHARD_COUNTS:
        out_parts = torch.randn(num_parts, case.batch, NUM_HEADS, HEAD_DIM, dtype=torch.float32, device=case.q.device)
        lse_parts = torch.randn(num_parts, case.batch, NUM_HEADS, dtype=torch.float32, device=case.q.device) * 4
        t_merge = timer(lambda: merge_attention_states(out_parts, lse_parts))
        result["merge"].append({"parts": num_parts, "merge_ms": t_merge, "fraction_of_micro": t_merge / t_micro})

        plans = case.shard_plans(num_parts)

        def sharded() -> torch.Tensor:
            parts = [run_micro_attention(p, case.q, case.kv_pool, case.layer) for p in plans]
            return merge_attention_states([p.out for p in parts], [p.lse for p in parts]).out

        batched_plan = case.batched_shard_plan(num_parts)
        q_rep = case.q.repeat(len(plans), 1, 1)

        def batched() -> torch.Tensor:
            part = run_micro_attention(batched_plan, q_rep, case.kv_pool, case.layer)
            out = part.out.view(len(plans), case.batch, NUM_HEADS, HEAD_DIM)
            lse = part.lse.view(len(plans), case.batch, NUM_HEADS)
            return merge_attention_states(out, lse).out

        shard_err = max(rel_error(sharded(), ref), rel_error(batched(), ref))
        t_sharded = timer(sharded)
        t_batched = timer(batched)
        result["shards"].append({
            "parts": len(plans),
            "separate_kernels_ms": t_sharded,
            "batched_kernel_ms": t_batched,
            "separate_vs_whole": t_sharded / t_micro,
            "batched_vs_whole": t_batched / t_micro,
            "rel_error_vs_sdpa": shard_err,
        })
    return result


def write_report(path: Path, header: dict, results: list[dict]) -> None:
    path.write_text(json.dumps({**header, "cases": results}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=None, help="comma-separated BATCHxCONTEXT list")
    parser.add_argument("--block-sizes", default="16,64")
    parser.add_argument("--sweep", action="store_true", help="only time every kernel config (tuning)")
    parser.add_argument("--eager", action="store_true", help="time eager launches instead of graph replays")
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes = [parse_shape(s) for s in (args.shapes.split(",") if args.shapes else (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES))]
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    timer = Timer(device, use_graphs=not args.eager)
    if device.type == "cuda":
        gpu_name = torch.cuda.get_device_name(device)
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        gpu_name, num_sms = "cpu", 0

    copy_gbps = copy_bandwidth(device, timer, (4 << 30) if device.type == "cuda" else (256 << 20))
    print(f"{gpu_name}: copy {copy_gbps:.0f} GB/s (read + write)", flush=True)
    import triton

    header = {
        "gpu": gpu_name,
        "num_sms": num_sms,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "dtype": str(dtype),
        "heads": {"num_heads": NUM_HEADS, "num_kv_heads": NUM_KV_HEADS, "head_dim": HEAD_DIM},
        "timing": "do_bench median of eager launches" if args.eager or device.type != "cuda" else "do_bench_cudagraph median",
        "copy_gbps": copy_gbps,
    }
    tag = gpu_name.lower().replace("nvidia ", "").replace(" ", "-")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / (f"kernels-sweep-{tag}.json" if args.sweep else f"kernels-{tag}.json")
    results = []
    for block_size in block_sizes:
        for batch, context in shapes:
            case = DecodeCase(batch, context, block_size, device, dtype)
            row = measure_case(case, timer, copy_gbps, args.sweep, num_sms)
            results.append(row)
            write_report(path, header, results)
            del case
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if args.sweep:
                continue
            print(
                f"bs={block_size:3d} {batch:3d}x{context:<7d} micro {row['micro_gbps']:6.0f} GB/s "
                f"sdpa {row['sdpa_gbps']:6.0f} GB/s  x{row['micro_vs_sdpa']:.3f} sdpa  "
                f"x{row['micro_vs_copy']:.3f} copy  lse +{100 * row['lse_cost']:.1f}%  err {row['rel_error_vs_sdpa']:.1e}",
                flush=True,
            )

    write_report(path, header, results)
    print(f"\n{gpu_name}  copy {copy_gbps:.0f} GB/s  -> {path}")
    if args.sweep:
        return
    print(f"{'bs':>3} {'BxN':>10} {'GB/s':>6} {'/sdpa':>6} {'/copy':>6} {'lse%':>5} {'merge%(P=2..16)':>22} {'shards sep/batched (P=2..16)':>40}")
    for r in results:
        merge = " ".join(f"{100 * m['fraction_of_micro']:.1f}" for m in r["merge"])
        shards = " ".join(f"{s['separate_vs_whole']:.2f}/{s['batched_vs_whole']:.2f}" for s in r["shards"])
        print(f"{r['block_size']:>3} {r['batch']:>3}x{r['context']:<6} {r['micro_gbps']:6.0f} {r['micro_vs_sdpa']:6.3f} "
              f"{r['micro_vs_copy']:6.3f} {100 * r['lse_cost']:5.1f} {merge:>22} {shards:>40}")


if __name__ == "__main__":
    main()
