"""The gManager's policy and the cluster simulator: planning time, throughput against baselines.

Measures, in one run:

* planning time of one :func:`plan` round against cluster size (64 to 4,096 instances,
  about 98 requests each; the snapshot of :func:`synthetic_snapshot`), median of 5;
* simulated throughput of Infinite-LLM against many static instances (vLLM-multi) and one
  instance over all GPUs (vLLM-single) on a short-context and a long-context trace, at a
  saturating request rate and over a sweep of rates (the figure ``docs/scheduler-throughput.png``);
* the perf model's held-out error, from ``bench/results/perf_model-cpu.json`` (written by
  ``python -m infinite_llm.scheduler.calibrate``).

The simulated cluster is 32 GPUs, each an A100-80GB running Llama-3-8B (roofline perf model of
:func:`gpu_roofline_model`: 2.0 TB/s, 312 TFLOP/s at 70%), 60 GB of KV each; vLLM-single pays
ring all-reduces over 4 nodes (25 GB/s per GPU, 8 us per step).

Usage: ``python bench/scheduler.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from infinite_llm.scheduler.perf_model import TensorParallelModel
from infinite_llm.scheduler.policy import Thresholds, plan
from infinite_llm.scheduler.simulator import (
    ClusterConfig,
    gpu_roofline_model,
    make_trace,
    simulate,
    synthetic_snapshot,
)

ROOT = Path(__file__).resolve().parent.parent
REQUESTS_PER_INSTANCE = 100_000 / 1024
CLUSTER_SIZES = [64, 256, 1024, 4096]
KV_TOKENS_PER_GPU = 460_000  # 60 GB / 128 KiB per token (Llama-3-8B, bf16)


def time_policy(sizes: list[int]) -> list[dict]:
    model = gpu_roofline_model()
    thresholds = Thresholds(debtor_max_batch=32, creditor_max_used_fraction=0.9)
    rows = []
    for size in sizes:
        snap = synthetic_snapshot(size, int(round(size * REQUESTS_PER_INSTANCE)))
        times, moves = [], []
        for _ in range(5):
            start = time.perf_counter()
            moves = plan(snap, model, thresholds)
            times.append(time.perf_counter() - start)
        start = time.perf_counter()
        scan_moves = plan(snap, model, thresholds, search="scan")
        scan_s = time.perf_counter() - start
        rows.append({
            "instances": size, "requests": len(snap.placement), "moves": len(moves),
            "plan_ms_median": statistics.median(times) * 1e3, "plan_ms_min": min(times) * 1e3,
            "scan_ms": scan_s * 1e3, "same_plan_as_scan": moves == scan_moves,
        })
        print(f"plan {size:5d} instances {len(snap.placement):7d} requests: {rows[-1]['plan_ms_median']:7.1f} ms "
              f"({len(moves)} moves; scan {scan_s * 1e3:.0f} ms, same plan: {moves == scan_moves})")
    return rows


def cluster(num_instances: int) -> ClusterConfig:
    return ClusterConfig(
        num_instances=num_instances,
        blocks_per_instance=KV_TOKENS_PER_GPU // 16,
        tensor_parallel=TensorParallelModel(num_kv_heads=8, hidden_size=4096, allreduce_latency_s=8e-6, link_bytes_per_s=25e9),
    )


def run_traces(num_requests: int, rates: dict[str, list[float]]) -> dict:
    model = gpu_roofline_model()
    config = cluster(32)
    out = {}
    for kind, kind_rates in rates.items():
        sweep = []
        for rate in kind_rates:
            trace = make_trace(kind, num_requests, rate, seed=7)
            row = {"rate_per_s": rate}
            for policy in ("infinite", "static", "single"):
                start = time.perf_counter()
                result = simulate(trace, model, config, policy)
                row[policy] = asdict(result) | {"wall_s": time.perf_counter() - start}
            row["ratio_vs_static"] = row["infinite"]["throughput_tokens_per_s"] / row["static"]["throughput_tokens_per_s"]
            row["ratio_vs_single"] = row["infinite"]["throughput_tokens_per_s"] / row["single"]["throughput_tokens_per_s"]
            sweep.append(row)
            print(f"{kind:5s} rate {rate:6.0f}/s  tokens/s infinite {row['infinite']['throughput_tokens_per_s']:8.0f}  "
                  f"static {row['static']['throughput_tokens_per_s']:8.0f} (rejected {row['static']['num_rejected']})  "
                  f"single {row['single']['throughput_tokens_per_s']:8.0f}  x{row['ratio_vs_static']:.2f} / x{row['ratio_vs_single']:.2f}")
        out[kind] = sweep
    return out


def plot(traces: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(5.5 * len(traces), 4))
    for ax, (kind, sweep) in zip(np.atleast_1d(axes), traces.items()):
        rates = [row["rate_per_s"] for row in sweep]
        for policy, label in (("infinite", "Infinite-LLM"), ("static", "vLLM-multi (32 static; drops requests > 1 GPU)"), ("single", "vLLM-single (TP 32)")):
            ax.plot(rates, [row[policy]["throughput_tokens_per_s"] for row in sweep], marker="o", label=label)
        ax.set_xscale("log")
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title(f"{kind} trace, 32 x A100-80GB (simulated)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and rates (a smoke run)")
    args = parser.parse_args()
    sizes = CLUSTER_SIZES[:2] if args.quick else CLUSTER_SIZES
    num_requests = 400 if args.quick else 2000
    rates = {"short": [25, 100, 400, 1600], "long": [10, 40, 160, 640]}
    if args.quick:
        rates = {kind: values[::2] for kind, values in rates.items()}

    policy_rows = time_policy(sizes)
    traces = run_traces(num_requests, rates)
    perf_model_path = ROOT / "bench/results/perf_model-cpu.json"
    perf_model = json.loads(perf_model_path.read_text()) if perf_model_path.exists() else None
    saturated = {kind: sweep[-1] for kind, sweep in traces.items()}
    results = {
        "machine": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "policy_time": policy_rows,
        "simulated_cluster": asdict(cluster(32)),
        "traces": traces,
        "saturated_ratios": {
            kind: {"vs_static": row["ratio_vs_static"], "vs_single": row["ratio_vs_single"],
                   "static_rejected": row["static"]["num_rejected"]}
            for kind, row in saturated.items()
        },
        "perf_model_cpu": None if perf_model is None else {
            "holdout_mape_pct": perf_model["fit_report"]["holdout_mape_pct"],
            "train_mape_pct": perf_model["fit_report"]["train_mape_pct"],
            "holdout_max_ape_pct": perf_model["fit_report"]["holdout_max_ape_pct"],
        },
    }
    if not args.quick:
        (ROOT / "bench/results/scheduler-cpu.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        plot(traces, ROOT / "docs/scheduler-throughput.png")
    print()
    print("| trace | infinite / static | infinite / single | static rejected |")
    print("|---|---|---|---|")
    for kind, r in results["saturated_ratios"].items():
        print(f"| {kind} | {r['vs_static']:.2f} | {r['vs_single']:.2f} | {r['static_rejected']} |")
    if perf_model:
        print(f"perf model (CPU) held-out MAPE {results['perf_model_cpu']['holdout_mape_pct']:.1f}%")


if __name__ == "__main__":
    main()
