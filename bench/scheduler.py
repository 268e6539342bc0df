"""The gManager's policy and the cluster simulator: planning time, throughput against baselines.

Measures, in one run:

* planning time of one :func:`plan` round against cluster size (64 to 4,096 instances,
  about 98 requests each; the snapshot of :func:`synthetic_snapshot`), median of 5, on the
  machine running this script;
* simulated throughput of Infinite-LLM against many static instances (vLLM-multi: one GPU
  each, and four GPUs each by tensor parallelism, the fewest that hold a 2000K-token request)
  and one instance over all GPUs (vLLM-single) on a short-context and a long-context trace,
  over a sweep of request rates (the figure ``docs/scheduler-throughput.png``);
* the perf models' held-out errors, from ``bench/results/perf_model-h200.json`` (used by the
  simulation) and ``bench/results/perf_model-cpu.json`` (both written by
  ``python -m infinite_llm.scheduler.calibrate``).

The simulated cluster is 32 NVIDIA H200 GPUs (4 nodes of 8), each running Llama-3-8B with the
perf model calibrated on an H200 (``perf_model-h200.json``, bf16) and 108 GB of KV (vLLM's 90%
of 141 GB, less 16 GB of weights and 2 GB of activations: 824K tokens at 128 KiB per token).
Tensor parallelism: all-reduces over InfiniBand across nodes (50 GB/s per GPU, 8 us per step)
for the 32-GPU instance, over NVLink inside a node (450 GB/s, 3 us) for 4-GPU instances; the
part of the dense time that does not split across GPUs is the calibrated fixed dense time
less the time to read one layer's weights at the calibrated HBM bandwidth.

Throughput is measured over the arrival window (first to last arrival), each rate's trace
lasting ``DURATION_S`` of simulated time: at rates past saturation the window is the
cluster's sustained throughput, not the time to drain a backlog.

Usage: ``python bench/scheduler.py [--quick]``
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from infinite_llm.scheduler.perf_model import PerfModel, TensorParallelModel, load_model
from infinite_llm.scheduler.policy import Thresholds, plan
from infinite_llm.scheduler.simulator import ClusterConfig, make_trace, simulate, synthetic_snapshot

ROOT = Path(__file__).resolve().parent.parent
H200_MODEL = ROOT / "bench/results/perf_model-h200.json"
CPU_MODEL = ROOT / "bench/results/perf_model-cpu.json"
REQUESTS_PER_INSTANCE = 100_000 / 1024
CLUSTER_SIZES = [64, 256, 1024, 4096]
NUM_GPUS = 32
KV_TOKENS_PER_GPU = 824_000  # 108 GB / 128 KiB per token (Llama-3-8B, bf16)
STATIC_TP_GPUS = 4  # the fewest GPUs (a power of two) whose KV holds a 2000K-token request
DURATION_S = 40.0
RATES = {"short": [50, 100, 200, 400, 800], "long": [25, 50, 100, 200, 400, 800]}
# (name, policy, GPUs per static instance)
BASELINES = (("infinite", "infinite", 1), ("static", "static", 1), ("static_tp4", "static", STATIC_TP_GPUS), ("single", "single", 1))
LABELS = {
    "infinite": "Infinite-LLM (32 instances)",
    "static": "vLLM-multi, 32 x 1 GPU (rejects requests > 1 GPU)",
    "static_tp4": "vLLM-multi, 8 x 4 GPUs (TP 4)",
    "single": "vLLM-single, 1 x 32 GPUs (TP 32)",
}


def unsplit_dense_s(model: PerfModel, shape: dict) -> float:
    """Per-layer dense time that tensor parallelism does not divide (s).

    The calibrated fixed dense time less the time to read one layer's weights at the HBM
    bandwidth the same calibration measured for KV reads (above its token knee, where the
    attention term streams from HBM): what is left is per-kernel and host work, which every
    GPU of a tensor-parallel group repeats.
    """
    h, d = shape["hidden_size"], shape["head_dim"]
    weights = h * (shape["num_heads"] + 2 * shape["num_kv_heads"]) * d + shape["num_heads"] * d * h
    weights += 3 * h * shape["intermediate_size"]
    kv_bytes_per_layer_token = 2 * shape["num_kv_heads"] * d * 2  # K and V, bf16
    hbm_bytes_per_s = kv_bytes_per_layer_token / (model.attn_s_per_token + model.attn_s_per_token_above_knee)
    return max(0.0, model.dense_fixed_s - weights * 2 / hbm_bytes_per_s)


def clusters(model: PerfModel, shape: dict) -> dict[str, ClusterConfig]:
    unsplit = unsplit_dense_s(model, shape)
    across_nodes = TensorParallelModel(
        num_kv_heads=shape["num_kv_heads"], hidden_size=shape["hidden_size"],
        allreduce_latency_s=8e-6, link_bytes_per_s=50e9, unsplit_dense_s=unsplit,
    )
    in_node = replace(across_nodes, allreduce_latency_s=3e-6, link_bytes_per_s=450e9)
    base = ClusterConfig(num_instances=NUM_GPUS, blocks_per_instance=KV_TOKENS_PER_GPU // 16, tensor_parallel=across_nodes)
    return {
        "infinite": base, "static": base, "single": base,
        "static_tp4": replace(base, tensor_parallel=in_node, static_gpus_per_instance=STATIC_TP_GPUS),
    }


def time_policy(model: PerfModel, sizes: list[int]) -> list[dict]:
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


def run_traces(model: PerfModel, configs: dict[str, ClusterConfig], rates: dict[str, list[float]], duration_s: float) -> dict:
    out = {}
    for kind, kind_rates in rates.items():
        sweep = []
        for rate in kind_rates:
            trace = make_trace(kind, int(rate * duration_s), rate, seed=7)
            row = {"rate_per_s": rate, "num_requests": len(trace)}
            for name, policy, _ in BASELINES:
                start = time.perf_counter()
                result = simulate(trace, model, configs[name], policy, until_s=trace[-1].arrival_s)
                row[name] = asdict(result) | {"wall_s": time.perf_counter() - start}
            tput = {name: row[name]["window_throughput_tokens_per_s"] for name, _, _ in BASELINES}
            row["ratios"] = {name: tput["infinite"] / tput[name] for name in tput if name != "infinite"}
            sweep.append(row)
            print(f"{kind:5s} rate {rate:5.0f}/s  tokens/s " + "  ".join(f"{n} {tput[n]:7.0f}" for n in tput)
                  + f"  (static rejected {row['static']['num_rejected']})  x "
                  + " / ".join(f"{row['ratios'][n]:.2f}" for n in row["ratios"]))
        out[kind] = sweep
    return out


def ablations(model: PerfModel, configs: dict[str, ClusterConfig], rates: dict[str, float], duration_s: float) -> dict:
    """Throughput ratios at one rate per trace with one assumption changed at a time: why the
    ratios are what they are, not results of their own."""
    single = configs["single"]
    tp = single.tensor_parallel
    variants = {
        "infinite, no plan (debtor_max_batch 0)": ("infinite", model, replace(configs["infinite"], thresholds=Thresholds(0, 0.9))),
        "infinite, no remote overhead": ("infinite", replace(model, remote_overhead_s=0.0), configs["infinite"]),
        "single, 32 KV heads (no replication)": ("single", model, replace(single, tensor_parallel=replace(tp, num_kv_heads=32))),
        "single, 32 KV heads, NVLink-speed all-reduce": (
            "single", model, replace(single, tensor_parallel=replace(tp, num_kv_heads=32, allreduce_latency_s=3e-6, link_bytes_per_s=450e9))),
    }
    out = {}
    for kind, rate in rates.items():
        trace = make_trace(kind, int(rate * duration_s), rate, seed=7)
        tput = lambda policy, m, config: simulate(trace, m, config, policy, until_s=trace[-1].arrival_s).window_throughput_tokens_per_s  # noqa: E731
        infinite, static = tput("infinite", model, configs["infinite"]), tput("static", model, configs["static"])
        row = {"rate_per_s": rate, "infinite_over_static": infinite / static}
        for name, (policy, m, config) in variants.items():
            value = tput(policy, m, config)
            row[name] = value / static if policy == "infinite" else infinite / value
        out[kind] = row
        print(f"ablation {kind} at {rate:g}/s: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items() if k != "rate_per_s"))
    return out


def plot(traces: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.3))
    for ax, (kind, sweep) in zip(np.atleast_1d(axes), traces.items()):
        rates = [row["rate_per_s"] for row in sweep]
        for name, _, _ in BASELINES:
            ax.plot(rates, [row[name]["window_throughput_tokens_per_s"] for row in sweep], marker="o", label=LABELS[name])
        ax.set_xscale("log")
        ax.set_xticks(rates, [f"{rate:g}" for rate in rates])
        ax.minorticks_off()
        ax.set_xlabel("request rate (requests/s)")
        ax.set_ylabel("decode throughput (tokens/s)")
        ax.set_title(f"{kind} trace, 32 x H200, Llama-3-8B (simulated, H200-calibrated model)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def model_error(path: Path) -> dict | None:
    if not path.exists():
        return None
    document = json.loads(path.read_text())
    report = document["fit_report"]
    return {
        "device": document.get("device"), "torch_version": document.get("torch_version"),
        "holdout_mape_pct": report["holdout_mape_pct"], "train_mape_pct": report["train_mape_pct"],
        "holdout_max_ape_pct": report["holdout_max_ape_pct"], "num_points": report["num_train"] + report["num_holdout"],
        "holdout_mape_over_splits": document.get("holdout_mape_over_splits"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes, rates and seconds (a smoke run)")
    args = parser.parse_args()
    sizes = CLUSTER_SIZES[:2] if args.quick else CLUSTER_SIZES
    duration_s = 10.0 if args.quick else DURATION_S
    rates = {kind: values[::2] for kind, values in RATES.items()} if args.quick else RATES

    model = load_model(H200_MODEL)
    shape = json.loads(H200_MODEL.read_text())["shape"]
    configs = clusters(model, shape)
    policy_rows = time_policy(model, sizes)
    traces = run_traces(model, configs, rates, duration_s)
    ablation = ablations(model, configs, {kind: values[-1] for kind, values in rates.items()}, duration_s)
    saturated = {kind: sweep[-1] for kind, sweep in traces.items()}
    results = {
        "machine": platform.processor() or platform.machine(),
        "numpy": np.__version__,
        "policy_time": policy_rows,
        "simulated_cluster": {name: asdict(config) for name, config in configs.items()},
        "perf_model": str(H200_MODEL.relative_to(ROOT)),
        "duration_s": duration_s,
        "traces": traces,
        "saturated_ratios": {
            kind: row["ratios"] | {"rate_per_s": row["rate_per_s"], "static_rejected": row["static"]["num_rejected"]}
            for kind, row in saturated.items()
        },
        # infinite variants: infinite / static; single variants: infinite / single variant
        "ablations": ablation,
        "perf_model_error": {"h200": model_error(H200_MODEL), "cpu": model_error(CPU_MODEL)},
    }
    if not args.quick:
        (ROOT / "bench/results/scheduler-h200.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
        plot(traces, ROOT / "docs/scheduler-throughput.png")
    print()
    print("| trace | rate | / vLLM-multi 1 GPU | / vLLM-multi TP4 | / vLLM-single | multi rejected |")
    print("|---|---|---|---|---|---|")
    for kind, sweep in traces.items():
        for row in sweep:
            r = row["ratios"]
            print(f"| {kind} | {row['rate_per_s']:g} | {r['static']:.2f} | {r['static_tp4']:.2f} | {r['single']:.2f} | "
                  f"{row['static']['num_rejected']} |")
    for name, error in results["perf_model_error"].items():
        if error:
            print(f"perf model ({name}, {error['device']}) held-out MAPE {error['holdout_mape_pct']:.1f}%")


if __name__ == "__main__":
    main()
