"""APB prefill's per-host attention: the prefix + causal Triton kernel against torch SDPA.

For Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, bf16) and chunks of n rows
whose prefix is a quarter-chunk anchor plus 2048 passing keys (``prefix_len = n / 4 + 2048``),
times, side by side in one run:

* ``prefix_causal_attention``, the one Triton kernel (autotuned; ``--sweep`` also times each
  tile config on its own). On Hopper both of its kernels are timed, the one that moves tiles by
  tensor descriptors (TMA, ``descriptors=True``) and the default one of per-thread pointer loads;
* the same work through ``scaled_dot_product_attention(enable_gqa=True)``: two calls, the prefix
  unmasked and the chunk causal, without the merge (a lower bound on that path);
* what ``engine/seq_parallel.apb_prefill`` runs today: two ``attention_with_lse`` calls
  (``aten._scaled_dot_product_flash_attention`` over repeat-interleaved K and V) and
  ``merge_attention_states``.

Effective FLOPs count the visible scores only: ``4 * n * heads * head_dim * (prefix_len +
(n + 1) / 2)``. Times are medians of CUDA-event timed eager launches after a warm-up. Each
shape's maximum absolute error against the float32 torch reference goes into the report.
Writes ``bench/results/apb_kernel-<gpu>.json``. Without CUDA (or with ``--smoke``) it runs one
tiny shape in float32 on the CPU and exits.

Usage: ``python bench/apb_kernel.py [--rows 4096,8192,16384] [--sweep] [--smoke] [--out PATH]``
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from infinite_llm.engine.seq_parallel import attention_with_lse
from infinite_llm.kernels import (
    PrefixAttentionConfig,
    merge_attention_states,
    prefix_causal_attention,
    prefix_causal_attention_torch,
)

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GPU_ROWS = [4096, 8192, 16384]
PASSING_LEN = 2048  # keys of the passing blocks from earlier hosts, beside the anchor
SMOKE = {"rows": 48, "prefix_len": 40, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
WARMUP, RUNS = 5, 25


def prefix_len_of(n: int) -> int:
    """The anchor (a quarter of a chunk) and the passing blocks."""
    return n // 4 + PASSING_LEN


def effective_flops(n: int, prefix_len: int, num_heads: int, head_dim: int) -> float:
    """Two matmuls (QK^T, PV) of 2 FLOPs per multiply-add over the keys each row sees."""
    return 4.0 * n * num_heads * head_dim * (prefix_len + (n + 1) / 2)


def gpu_tag(device: torch.device) -> str:
    """The result files' device name, as ``bench/kernels.py`` writes it (``h200``, ``cpu``)."""
    if device.type != "cuda":
        return "cpu"
    return torch.cuda.get_device_name(device).lower().replace("nvidia ", "").replace(" ", "-")


def median_ms(fn: Callable[[], object], device: torch.device) -> float:
    """Median over RUNS calls after WARMUP calls: CUDA events on the GPU, wall clock on the CPU."""
    for _ in range(WARMUP):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(RUNS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(RUNS):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Case:
    """One chunk: q ``[n, heads, head_dim]`` and k, v ``[prefix_len + n, kv_heads, head_dim]``."""

    def __init__(self, n: int, prefix_len: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(n * 1_000_003 + prefix_len)
        self.n, self.prefix_len, self.num_heads, self.head_dim = n, prefix_len, num_heads, head_dim
        self.sm_scale = 1.0 / math.sqrt(head_dim)
        self.q = torch.randn(n, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
        self.k = torch.randn(prefix_len + n, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
        self.v = torch.randn(prefix_len + n, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
        # [1, heads, tokens, head_dim] views for SDPA.
        self.q4 = self.q.transpose(0, 1).unsqueeze(0)
        self.k4 = self.k.transpose(0, 1).unsqueeze(0)
        self.v4 = self.v.transpose(0, 1).unsqueeze(0)

    def triton(self, config: PrefixAttentionConfig | None = None, descriptors: bool | None = None):
        return prefix_causal_attention(self.q, self.k, self.v, prefix_len=self.prefix_len, sm_scale=self.sm_scale,
                                       config=config, descriptors=descriptors)

    def sdpa_two_calls(self) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.prefix_len
        prefix = F.scaled_dot_product_attention(self.q4, self.k4[:, :, :p], self.v4[:, :, :p],
                                                scale=self.sm_scale, enable_gqa=True)
        own = F.scaled_dot_product_attention(self.q4, self.k4[:, :, p:], self.v4[:, :, p:], is_causal=True,
                                             scale=self.sm_scale, enable_gqa=True)
        return prefix, own

    def flash_two_calls_merged(self) -> torch.Tensor:
        """``apb_prefill``'s attention of the chunk rows: two calls, then the exact merge."""
        p = self.prefix_len
        own = attention_with_lse(self.q, self.k[p:], self.v[p:], causal=True, sm_scale=self.sm_scale)
        prefix = attention_with_lse(self.q, self.k[:p], self.v[:p], causal=False, sm_scale=self.sm_scale)
        return merge_attention_states([own.out.float(), prefix.out.float()], [own.lse, prefix.lse],
                                      out_dtype=self.q.dtype).out

    def reference(self):
        return prefix_causal_attention_torch(self.q, self.k, self.v, prefix_len=self.prefix_len,
                                             sm_scale=self.sm_scale)


# Tiles ``--sweep`` times beside the autotune list's (block_m, block_n, num_warps, num_stages):
# deeper pipelines, wider key blocks and 256-row blocks, to see whether the list misses a faster one.
EXTRA_SWEEP = [(128, 64, 4, 4), (128, 64, 8, 4), (128, 128, 8, 3), (128, 128, 4, 2), (64, 128, 4, 3),
               (256, 64, 8, 3)]


def sweep_configs(descriptors: bool = False) -> list[PrefixAttentionConfig]:
    """The autotune list's configs (of the pointer or the descriptor kernel), then
    :data:`EXTRA_SWEEP`'s."""
    from infinite_llm.kernels.prefix_attention_kernel import CUDA_CONFIGS, CUDA_DESCRIPTOR_CONFIGS

    configs = CUDA_DESCRIPTOR_CONFIGS if descriptors else CUDA_CONFIGS
    listed = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in configs]
    return [PrefixAttentionConfig(block_m=m, block_n=n, num_warps=w, num_stages=st)
            for m, n, w, st in dict.fromkeys(listed + EXTRA_SWEEP)]


def measure(case: Case, device: torch.device, sweep: bool) -> dict:
    flops = effective_flops(case.n, case.prefix_len, case.num_heads, case.head_dim)
    ref = case.reference()
    got = case.triton()
    merged = case.flash_two_calls_merged()
    row = {
        "n": case.n,
        "prefix_len": case.prefix_len,
        "effective_tflop": flops / 1e12,
        "max_abs_error_vs_reference": {
            "triton": (got.out.float() - ref.out.float()).abs().max().item(),
            "triton_lse": (got.lse - ref.lse).abs().max().item(),
            "flash_two_calls_merged": (merged.float() - ref.out.float()).abs().max().item(),
        },
    }
    ref_out_all = ref.out.float()
    ref_out = ref_out_all if sweep and device.type == "cuda" else None
    del ref, got, merged
    timings = {
        "triton": median_ms(case.triton, device),
        "sdpa_two_calls": median_ms(case.sdpa_two_calls, device),
        "flash_two_calls_merged": median_ms(case.flash_two_calls_merged, device),
    }
    # The two Triton kernels side by side where the device takes descriptors (auto picks one).
    with_descriptors = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    if with_descriptors:
        pointers = case.triton(descriptors=False)
        row["max_abs_error_vs_reference"]["triton_pointers"] = (pointers.out.float() - ref_out_all).abs().max().item()
        del pointers
        timings["triton_pointers"] = median_ms(lambda: case.triton(descriptors=False), device)
        timings["triton_descriptors"] = median_ms(lambda: case.triton(descriptors=True), device)
    if sweep and device.type == "cuda":
        for descriptors in ([False, True] if with_descriptors else [False]):
            for cfg in sweep_configs(descriptors):
                kind = "desc" if descriptors else "ptr"
                name = f"triton_{kind}_{cfg.block_m}x{cfg.block_n}_w{cfg.num_warps}_s{cfg.num_stages}"
                try:
                    timings[name] = median_ms(lambda: case.triton(cfg, descriptors), device)
                    err = (case.triton(cfg, descriptors).out.float() - ref_out).abs().max().item()
                    row["max_abs_error_vs_reference"][name] = err
                except Exception as exc:  # a config that does not fit this GPU's shared memory
                    row.setdefault("failed_configs", {})[name] = repr(exc)[:200]
    row["ms"] = timings
    row["tflops"] = {name: flops / (ms * 1e-3) / 1e12 for name, ms in timings.items()}
    row["triton_over_sdpa"] = timings["sdpa_two_calls"] / timings["triton"]
    row["triton_over_flash_merged"] = timings["flash_two_calls_merged"] / timings["triton"]
    for name in ("triton_pointers", "triton_descriptors"):
        if name in timings:
            row[f"{name}_over_sdpa"] = timings["sdpa_two_calls"] / timings[name]
    if device.type == "cuda":
        from infinite_llm.kernels.prefix_attention_kernel import (
            prefix_causal_attention_autotuned,
            prefix_causal_attention_desc_autotuned,
        )

        row["autotuned_config"] = str(prefix_causal_attention_autotuned.best_config)
        if with_descriptors:
            row["autotuned_descriptor_config"] = str(prefix_causal_attention_desc_autotuned.best_config)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default=",".join(map(str, GPU_ROWS)), help="comma-separated chunk rows n")
    parser.add_argument("--sweep", action="store_true", help="also time each tile config without autotuning")
    parser.add_argument("--smoke", action="store_true", help="one tiny float32 shape (the default without CUDA)")
    parser.add_argument("--out", default="", help="report path; default bench/results/apb_kernel-<gpu>.json")
    args = parser.parse_args()

    # The smoke run checks the harness on the CPU, where the two-call baselines take float32.
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    smoke = args.smoke or device.type != "cuda"
    if smoke:
        shapes = [(SMOKE["rows"], SMOKE["prefix_len"], SMOKE["num_heads"], SMOKE["num_kv_heads"], SMOKE["head_dim"])]
        dtype = torch.float32
    else:
        shapes = [(n, prefix_len_of(n), NUM_HEADS, NUM_KV_HEADS, HEAD_DIM) for n in map(int, args.rows.split(","))]
        dtype = torch.bfloat16
    import triton

    tag = gpu_tag(device)
    header = {
        "bench": "apb_kernel",
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "dtype": str(dtype),
        "smoke": smoke,
        # On the CPU "auto" runs the torch reference, unless TRITON_INTERPRET=1 runs the kernel.
        "triton_backend": ("triton" if device.type == "cuda" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
                           else "torch reference"),
        "timing": f"median of {RUNS} {'CUDA-event' if device.type == 'cuda' else 'wall-clock'} timed eager calls "
                  f"after {WARMUP} warm-up calls",
        "flops": "4 * n * heads * head_dim * (prefix_len + (n + 1) / 2)",
        "sdpa_two_calls": "F.scaled_dot_product_attention(enable_gqa=True) on the prefix and, causal, on the chunk; "
                          "no merge",
        "flash_two_calls_merged": "engine.seq_parallel.attention_with_lse twice (K, V repeat-interleaved) + "
                                  "merge_attention_states",
    }
    rows = []
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / (
        f"apb_kernel-{tag}-smoke.json" if smoke else f"apb_kernel-{tag}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for n, prefix_len, num_heads, num_kv_heads, head_dim in shapes:
        case = Case(n, prefix_len, num_heads, num_kv_heads, head_dim, dtype, device)
        rows.append({"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
                     **measure(case, device, args.sweep)})
        out.write_text(json.dumps({**header, "rows": rows}, indent=1) + "\n")
        del case
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(f"{header['gpu']}  {dtype}  heads {shapes[0][2]}/{shapes[0][3]}  head_dim {shapes[0][4]}")
    print(f"{'n':>6} {'prefix':>6} {'triton TF/s':>11} {'sdpa x2':>8} {'flash x2+merge':>14} "
          f"{'triton/sdpa':>11} {'triton/merged':>13} {'max err':>8}")
    for r in rows:
        t = r["tflops"]
        print(f"{r['n']:>6} {r['prefix_len']:>6} {t['triton']:>11.1f} {t['sdpa_two_calls']:>8.1f} "
              f"{t['flash_two_calls_merged']:>14.1f} {r['triton_over_sdpa']:>11.2f} {r['triton_over_flash_merged']:>13.2f} "
              f"{r['max_abs_error_vs_reference']['triton']:>8.1e}")
        if "triton_pointers" in t:
            print(f"        pointers {t['triton_pointers']:.0f} TF/s ({r['triton_pointers_over_sdpa']:.2f}x sdpa), "
                  f"descriptors {t['triton_descriptors']:.0f} TF/s ({r['triton_descriptors_over_sdpa']:.2f}x sdpa)")
        extra = {k: v for k, v in t.items() if k.startswith("triton_") and k not in ("triton_pointers",
                                                                                     "triton_descriptors")}
        if extra:
            print("        sweep: " + "  ".join(f"{k[7:]} {v:.0f}" for k, v in extra.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
