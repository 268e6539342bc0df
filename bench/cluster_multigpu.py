"""A cluster of one `infinited` per GPU serving a mixed-length trace: KV shared under the
gManager's greedy policy against static instances that never borrow (vLLM-multi), per request
rate, beside the simulator's prediction for the same trace.

Per policy the script starts real daemons (a local cluster; "infinite" also runs a gManager
with the perf model), replays the trace's arrivals through the instances' local API (each
request to the instance with the most pool tokens not yet promised to requests in flight, the
simulator's own rule), streams every request greedily with ``ignore_eos`` and records when
its first and last tokens came. A static instance refuses a request longer than its pool (as
vLLM-multi does); under "infinite" the home spills KV to its peers and the gManager moves
blocks when the perf model predicts a gain.

The simulator runs the same trace on the same pools with the perf model, the gManager's
thresholds, and prefill at the rate measured on this cluster in the same run (one prompt of
``--prefill-probe-tokens`` prefilled alone); the prediction's error is reported per rate and
policy, once with the perf model as calibrated and once with its remote overhead replaced by
the one the daemons measured (the home's wait per layer for a creditor's part, less the
creditor's time serving it).

One instance over all GPUs (vLLM-single) needs tensor parallelism, which the engine lacks: the
simulator's figure for it is reported beside, unmeasured.

    python bench/cluster_multigpu.py                                 # the CPU: SmolLM2-135M, 2 instances
    python bench/cluster_multigpu.py --device cuda --model /tmp/llama8b   # one instance per GPU
    python bench/cluster_multigpu.py --device cuda --mps --model /tmp/llama1b --pool-blocks 1024 --warm-up
        # two instances sharing GPU 0 through CUDA MPS (started by the caller)

Writes ``bench/results/cluster_multigpu-<gpu>-x<N>.json`` (``-mps-x<N>`` for instances sharing one
GPU, or ``-cpu``), after each policy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from infinite_llm.bench.daemon import histogram_totals, latency_means
from infinite_llm.daemon.local_cluster import LocalCluster, UnixHTTPConnection
from infinite_llm.scheduler.perf_model import load_model
from infinite_llm.scheduler.policy import Thresholds
from infinite_llm.scheduler.simulator import ClusterConfig, Request, make_trace, simulate

ROOT = Path(__file__).resolve().parent.parent
BLOCK_SIZE = 16
# The gManager's defaults (``python -m infinite_llm.scheduler.gmanager --help``), given to the
# simulator too.
PLAN_INTERVAL_S = 2.0
THRESHOLDS = Thresholds(debtor_max_batch=32, creditor_max_used_fraction=0.9, max_moves=16)
TOKEN_ID_RANGE = (1000, 30000)  # ordinary tokens in every Llama-family vocabulary


@dataclass
class Outcome:
    """One request of the trace as the cluster served it; times in s from the trace's start."""

    req_id: int
    inst_id: int
    prompt_tokens: int
    output_tokens: int
    sent_s: float
    first_token_s: float | None = None
    end_s: float | None = None
    tokens: int = 0
    status: int = 200  # HTTP status of /v1/generate
    error: str | None = None


def stream_request(inst_socket: Path, prompt: list[int], max_tokens: int, outcome: Outcome, t0: float,
                   timeout_s: float) -> None:
    """Stream one greedy request through the local API; fill in ``outcome``."""
    conn = UnixHTTPConnection(str(inst_socket), timeout=timeout_s)
    body = {"prompt": prompt, "params": {"temperature": 0, "max_tokens": max_tokens, "ignore_eos": True}}
    try:
        conn.request("POST", "/v1/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        outcome.status = response.status
        if response.status != 200:
            outcome.error = json.loads(response.read()).get("error", "?")
            return
        for line in response:
            if not line.strip():
                continue
            event = json.loads(line)
            if event.get("finish_reason") == "error":
                outcome.error = "the instance ended the request with an error"
            if event["token_ids"]:
                now = time.perf_counter() - t0
                outcome.first_token_s = outcome.first_token_s if outcome.first_token_s is not None else now
                outcome.tokens += len(event["token_ids"])
                outcome.end_s = now
    except Exception as exc:  # noqa: BLE001  recorded: a benchmark reports failures, it does not hide them
        outcome.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def replay(cluster: LocalCluster, trace: list[Request], pool_tokens: int, seed: int, timeout_s: float) -> list[Outcome]:
    """Send the trace's requests at their arrival times; each to the instance with the most pool
    tokens not promised to its requests in flight. Returns when every request has ended."""
    rng = np.random.default_rng(seed)
    outstanding = {inst.inst_id: 0 for inst in cluster}
    lock = threading.Lock()
    outcomes: list[Outcome] = []
    threads: list[threading.Thread] = []
    t0 = time.perf_counter()

    def serve(inst_id: int, prompt: list[int], request: Request, outcome: Outcome) -> None:
        stream_request(cluster[inst_id].socket_path, prompt, request.output_tokens, outcome, t0, timeout_s)
        with lock:
            outstanding[inst_id] -= request.prompt_tokens + request.output_tokens

    for request in trace:
        prompt = rng.integers(*TOKEN_ID_RANGE, request.prompt_tokens).tolist()
        delay = request.arrival_s - (time.perf_counter() - t0)
        if delay > 0:
            time.sleep(delay)
        with lock:
            inst_id = max(outstanding, key=lambda i: (pool_tokens - outstanding[i], -i))
            outstanding[inst_id] += request.prompt_tokens + request.output_tokens
        outcome = Outcome(request.req_id, inst_id, request.prompt_tokens, request.output_tokens,
                          sent_s=time.perf_counter() - t0)
        outcomes.append(outcome)
        thread = threading.Thread(target=serve, args=(inst_id, prompt, request, outcome), daemon=True)
        thread.start()
        threads.append(thread)
    deadline = time.monotonic() + timeout_s
    for thread in threads:
        thread.join(timeout=max(0.1, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"requests still running after {timeout_s} s")
    return outcomes


def summarise(outcomes: list[Outcome], trace: list[Request]) -> dict:
    """The measured counterparts of the simulator's figures."""
    done = [o for o in outcomes if o.error is None and o.status == 200 and o.end_s is not None]
    refused = [o for o in outcomes if 400 <= o.status < 500]
    start = trace[0].arrival_s
    makespan = max((o.end_s for o in done), default=start) - start
    latencies = [o.end_s - trace[o.req_id].arrival_s for o in done]
    tokens = sum(o.tokens for o in done)
    return {
        "num_requests": len(outcomes), "num_finished": len(done), "num_rejected": len(refused),
        "num_failed": len(outcomes) - len(done) - len(refused),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "generated_tokens": tokens, "makespan_s": makespan,
        "throughput_tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "mean_latency_s": statistics.fmean(latencies) if latencies else math.nan,
        "p99_latency_s": float(np.percentile(latencies, 99)) if latencies else math.nan,
        "mean_ttft_s": statistics.fmean(o.first_token_s - trace[o.req_id].arrival_s for o in done) if done else math.nan,
        "mean_per_token_latency_s": statistics.fmean(
            (o.end_s - trace[o.req_id].arrival_s) / o.output_tokens for o in done) if done else math.nan,
    }


def measure_prefill_rate(cluster: LocalCluster, tokens: int, timeout_s: float) -> float:
    """Prompt tokens per second of one instance prefilling one prompt alone (first token's wait)."""
    prompt = np.random.default_rng(12345).integers(*TOKEN_ID_RANGE, tokens).tolist()
    rates = []
    for _ in range(2):  # the first also compiles and warms up
        outcome = Outcome(-1, 1, tokens, 1, 0.0)
        t0 = time.perf_counter()
        stream_request(cluster[1].socket_path, prompt, 1, outcome, t0, timeout_s)
        if outcome.error or outcome.first_token_s is None:
            raise RuntimeError(f"prefill probe failed: {outcome.error}")
        rates.append(tokens / outcome.first_token_s)
    return rates[-1]


def warm_up(cluster: LocalCluster, short_tokens: int, long_tokens: int, timeout_s: float) -> list[dict]:
    """Before the timed rates: a short request, then one longer than a pool, to each instance in
    turn, one at a time, so that what the trace will run is compiled and captured first (a
    long one spills: the split path of both the home and the creditor). A static instance
    refuses the long ones. Returns each request's outcome."""
    rng = np.random.default_rng(4321)
    outcomes = []
    for inst in cluster:
        for tokens in (short_tokens, long_tokens):
            outcome = Outcome(-1, inst.inst_id, tokens, 8, 0.0)
            stream_request(inst.socket_path, rng.integers(*TOKEN_ID_RANGE, tokens).tolist(), 8, outcome,
                           time.perf_counter(), timeout_s)
            outcomes.append({"inst_id": inst.inst_id, "prompt_tokens": tokens, "status": outcome.status,
                             "tokens": outcome.tokens, "error": outcome.error, "end_s": outcome.end_s})
            time.sleep(2.5 if tokens == long_tokens else 0.0)  # creditors free the long one's segments
    return outcomes


def cluster_devices(on_cuda: bool, instances: int, mps: bool, gpu_count: int) -> list[str]:
    """Each instance's device: instance i on GPU i mod the GPU count, or with ``mps`` all on GPU 0."""
    if not on_cuda:
        return ["cpu"] * instances
    return ["cuda:0" if mps else f"cuda:{i % gpu_count}" for i in range(instances)]


def result_suffix(gpu: str | None, instances: int, mps: bool) -> str:
    """The result file's name after ``cluster_multigpu-``: the GPU and the instance count
    (``-mps-x<N>``: one GPU shared), or ``cpu``."""
    if gpu is None:
        return "cpu"
    return f"{gpu}-mps-x{instances}" if mps else f"{gpu}-x{instances}"


def predict(trace: list[Request], model, args, pool_blocks: int, prefill_tokens_per_s: float, policy: str) -> dict:
    cluster = ClusterConfig(num_instances=args.instances, blocks_per_instance=pool_blocks, block_size=BLOCK_SIZE,
                            max_batch_per_instance=args.max_num_seqs, plan_period_s=PLAN_INTERVAL_S,
                            thresholds=THRESHOLDS, prefill_tokens_per_s=prefill_tokens_per_s,
                            prefill_chunk_tokens=args.max_num_batched_tokens)
    result = asdict(simulate(trace, model, cluster, policy))
    return {k: result[k] for k in ("num_finished", "num_rejected", "generated_tokens", "makespan_s",
                                   "throughput_tokens_per_s", "mean_latency_s", "p99_latency_s", "num_moves")}


def relative_error(predicted: float, measured: float) -> float | None:
    return predicted / measured - 1 if measured and math.isfinite(measured) and math.isfinite(predicted) else None


def run_policy(policy: str, args, traces: dict[float, list[Request]], devices: list[str], perf_model_path: Path,
               extra_args: list[str], probe: bool) -> tuple[dict, float | None]:
    """Start the cluster for ``policy``, replay every rate's trace; (rows by rate, prefill rate).
    With ``args.warm_up``, the rows also hold "warm_up": the outcomes of ``warm_up``."""
    share = ["--share-kv"] if policy == "infinite" else ["--no-share-kv"]
    bypass = [] if args.queue_bypass_limit is None else ["--queue-bypass-limit", str(args.queue_bypass_limit)]
    bypass += [] if args.split_decode_interval is None else ["--split-decode-interval", str(args.split_decode_interval)]
    with tempfile.TemporaryDirectory(prefix="infllm-cluster-") as root:
        cluster = LocalCluster(Path(root), args.instances, args.pool_blocks, device=args.device, devices=devices,
                               max_num_batched_tokens=args.max_num_batched_tokens,
                               extra_args=[*extra_args, *share, "--max-num-seqs", str(args.max_num_seqs), *bypass],
                               gmanager_perf_model=perf_model_path if policy == "infinite" else None)
        try:
            cluster.wait_ready()
            prefill_rate = measure_prefill_rate(cluster, args.prefill_probe_tokens, args.timeout_s) if probe else None
            time.sleep(2.5)  # the peers republish their free blocks
            rows = {}
            if args.warm_up:
                rows["warm_up"] = warm_up(cluster, args.short[1], args.long[0], args.timeout_s)
                print(f"{policy:>9} warm-up: {json.dumps(rows['warm_up'])}", flush=True)
            for rate, trace in traces.items():
                before = histogram_totals(cluster)
                outcomes = replay(cluster, trace, args.pool_blocks * BLOCK_SIZE, seed=int(rate * 1000), timeout_s=args.timeout_s)
                rows[rate] = {"measured": summarise(outcomes, trace),
                              "latencies": latency_means(before, histogram_totals(cluster)),
                              "requests": [asdict(o) for o in outcomes]}
                if cluster.gmanager is not None:
                    rows[rate]["gmanager_moves"] = cluster.gmanager_status().get("moves", {})
                print(f"{policy:>9} rate {rate:g}/s: {json.dumps(rows[rate]['measured'])}", flush=True)
                time.sleep(2.5)  # creditors free the last requests' segments; peers republish
        except BaseException:
            for path in sorted(Path(root).glob("*.log")):
                print(f"--- {path.name}\n{path.read_text()[-2000:]}")
            raise
        finally:
            cluster.stop()
            if args.log_dir is not None:
                args.log_dir.mkdir(parents=True, exist_ok=True)
                for path in Path(root).glob("*.log"):
                    (args.log_dir / f"{policy}-{path.name}").write_text(path.read_text())
    return rows, prefill_rate


def remote_times_per_layer(rows: dict) -> tuple[float, float] | None:
    """Over every rate's run: the homes' mean wait for a creditor's part per layer, and the
    creditors' mean time serving one (s); None where no part was remote."""
    sums = {"remote_attention": [0.0, 0.0], "attend_serve": [0.0, 0.0]}
    for row in rows.values():
        for figures in row["latencies"].values():
            for key, acc in sums.items():
                if f"{key}_mean_s" in figures:
                    acc[0] += figures[f"{key}_mean_s"] * figures[f"{key}_count"]
                    acc[1] += figures[f"{key}_count"]
    (wait, waits), (serve, serves) = sums["remote_attention"], sums["attend_serve"]
    if not waits:
        return None
    return wait / waits, (serve / serves if serves else 0.0)


def add_predictions(results: dict, traces: dict, perf_model, args, prefill_rate: float) -> tuple:
    """Fill in every row's predictions and their errors; returns (the measured remote times per
    layer or None, the one-big-instance predictions by rate)."""
    remote = remote_times_per_layer(results.get("infinite", {}))
    # The perf model charges a remote part's attention itself (max of local and remote) plus
    # ``remote_overhead_s``: the measured overhead is the wait less the creditor's serving.
    measured_model = replace(perf_model, remote_overhead_s=max(0.0, remote[0] - remote[1])) if remote else None
    for name, policy_rows in results.items():
        for rate, row in policy_rows.items():
            row["predicted"] = predict(traces[rate], perf_model, args, args.pool_blocks, prefill_rate, name)
            row.pop("predicted_with_measured_remote", None)
            if measured_model is not None:
                row["predicted_with_measured_remote"] = predict(traces[rate], measured_model, args, args.pool_blocks,
                                                                prefill_rate, name)
            m = row["measured"]
            row["error"] = {key: {kind: relative_error(row[kind][key], m[key])
                                  for kind in ("predicted", "predicted_with_measured_remote") if kind in row}
                            for key in ("throughput_tokens_per_s", "mean_latency_s")}
    single = {rate: predict(trace, perf_model, args, args.pool_blocks, prefill_rate, "single") for rate, trace in traces.items()}
    return remote, single


def repredict(path: Path) -> None:
    """Recompute a saved report's predictions with this simulator (the measured rows stay)."""
    report = json.loads(path.read_text())
    t = report["trace"]
    args = argparse.Namespace(instances=report["instances"], pool_blocks=report["pool_blocks"],
                              max_num_seqs=report["max_num_seqs"], max_num_batched_tokens=report["max_num_batched_tokens"])
    perf_model = load_model(ROOT / report["perf_model"])
    any_rows = next(iter(report["policies"].values()))
    traces = {float(rate): make_trace("long", t["requests_per_rate"], float(rate), seed=t["seed"],
                                      long_fraction=t["long_fraction"], short_tokens=tuple(t["short_tokens"]),
                                      long_tokens=tuple(t["long_tokens"]), output_tokens=tuple(t["output_tokens"]))
              for rate in any_rows}
    results = {p: {float(rate): row for rate, row in rows.items()} for p, rows in report["policies"].items()}
    remote, single = add_predictions(results, traces, perf_model, args, report["prefill_tokens_per_s"])
    report["remote_wait_per_layer_s"] = remote[0] if remote else None
    report["remote_serve_per_layer_s"] = remote[1] if remote else None
    report["policies"] = {p: {str(rate): row for rate, row in rows.items()} for p, rows in results.items()}
    report["single_predicted_only"] = {str(rate): row for rate, row in single.items()}
    path.write_text(json.dumps(report, indent=2) + "\n")
    print_report(report)


def print_report(report: dict) -> None:
    remote_s = report["remote_wait_per_layer_s"]
    print(f"prefill {report['prefill_tokens_per_s']:.0f} tok/s; remote wait per layer "
          f"{'-' if remote_s is None else f'{remote_s * 1e3:.2f} ms'} (perf model: {report['perf_model_remote_overhead_s'] * 1e3:.3f} ms)")
    print(f"{'policy':>9} {'rate':>5} {'done':>5} {'refused':>7} {'tok/s':>8} {'predicted':>9} {'err':>7} "
          f"{'err (remote)':>12} {'mean lat s':>10} {'predicted':>9}")
    for policy, rows in report["policies"].items():
        for rate, row in rows.items():
            m, p, e = row["measured"], row["predicted"], row["error"]["throughput_tokens_per_s"]
            with_remote = e.get("predicted_with_measured_remote")
            print(f"{policy:>9} {float(rate):>5g} {m['num_finished']:>5} {m['num_rejected']:>7} {m['throughput_tokens_per_s']:>8.1f} "
                  f"{p['throughput_tokens_per_s']:>9.1f} {100 * (e['predicted'] or 0):>6.0f}% "
                  f"{'-' if with_remote is None else f'{100 * with_remote:.0f}%':>12} "
                  f"{m['mean_latency_s']:>10.2f} {p['mean_latency_s']:>9.2f}")
    for rate, row in report["single_predicted_only"].items():
        print(f"{'single':>9} {float(rate):>5g} (simulated only: the engine has no tensor parallelism) "
              f"{row['throughput_tokens_per_s']:.1f} tok/s, mean latency {row['mean_latency_s']:.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: instance i on GPU i")
    parser.add_argument("--instances", type=int, default=0, help="default: the GPU count (2 with --mps), 2 on the CPU")
    parser.add_argument("--mps", action="store_true",
                        help="every instance on GPU 0, the processes sharing it through CUDA MPS (started by the "
                             "caller); the result file says -mps-x<N>")
    parser.add_argument("--warm-up", action="store_true",
                        help="before the timed rates, a short and a long request to each instance in turn "
                             "(compiles and captures the split path before it is timed)")
    parser.add_argument("--model", default=None, help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--perf-model", type=Path, default=None,
                        help="the gManager's and the simulator's perf model (default: bench/results/perf_model-h200.json "
                             "on CUDA, perf_model-cpu.json on the CPU)")
    parser.add_argument("--pool-blocks", type=int, default=0, help="KV blocks per instance (default 96 on the CPU, 2048 on CUDA)")
    parser.add_argument("--rates", default="", help="request rates, req/s, comma-separated (default 0.3,0.6 on the CPU, 1,2,4 on CUDA)")
    parser.add_argument("--requests", type=int, default=0, help="requests per rate (default 8 on the CPU, 24 on CUDA)")
    parser.add_argument("--short-tokens", default="", help="low,high prompt tokens of the short requests")
    parser.add_argument("--long-tokens", default="", help="low,high prompt tokens of the long requests (past one instance's pool)")
    parser.add_argument("--long-fraction", type=float, default=0.2)
    parser.add_argument("--output-tokens", default="", help="low,high output tokens")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0, help="the prefill chunk (default 128 on the CPU, 8192 on CUDA)")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--prefill-probe-tokens", type=int, default=0, help="prompt of the prefill-rate probe (default 4 chunks)")
    parser.add_argument("--queue-bypass-limit", type=int, default=None,
                        help="the instances' --queue-bypass-limit (default: theirs)")
    parser.add_argument("--split-decode-interval", type=int, default=None,
                        help="the instances' --split-decode-interval (default: theirs)")
    parser.add_argument("--policies", default="infinite,static")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=900.0, help="bound on one rate's run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the daemons' and the gManager's logs here")
    parser.add_argument("--repredict", type=Path, default=None,
                        help="recompute the predictions of a saved report with this simulator, and nothing else")
    args = parser.parse_args()
    if args.repredict is not None:
        repredict(args.repredict)
        return
    # A `timeout` that ends the run stops the daemons too (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    on_cuda = args.device.startswith("cuda")
    if args.mps and not on_cuda:
        raise SystemExit("--mps needs --device cuda")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if not on_cuda:
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    args.instances = args.instances or (2 if args.mps else torch.cuda.device_count() if on_cuda else 2)
    args.pool_blocks = args.pool_blocks or (2048 if on_cuda else 96)
    args.requests = args.requests or (24 if on_cuda else 8)
    args.max_num_batched_tokens = args.max_num_batched_tokens or (8192 if on_cuda else 128)
    pool_tokens = args.pool_blocks * BLOCK_SIZE
    args.prefill_probe_tokens = args.prefill_probe_tokens or min(4 * args.max_num_batched_tokens, pool_tokens // 2)

    def pair(text: str, default: tuple[int, int]) -> tuple[int, int]:
        return tuple(int(v) for v in text.split(",")) if text else default

    short = pair(args.short_tokens, (64, pool_tokens // 8))
    long = pair(args.long_tokens, (int(1.1 * pool_tokens), int(1.6 * pool_tokens)))
    outputs = pair(args.output_tokens, (32, 128) if on_cuda else (8, 24))
    args.short, args.long = short, long
    rates = [float(r) for r in (args.rates or ("1,2,4" if on_cuda else "0.3,0.6")).split(",")]
    policies = args.policies.split(",")
    if unknown := set(policies) - {"infinite", "static"}:
        raise SystemExit(f"unknown policies {sorted(unknown)}: infinite, static")
    if long[1] + outputs[1] > args.instances * pool_tokens * 0.9:
        raise SystemExit(f"long prompts up to {long[1]} tokens do not fit {args.instances} pools of {pool_tokens} tokens")
    perf_model_path = args.perf_model or ROOT / "bench/results" / ("perf_model-h200.json" if on_cuda else "perf_model-cpu.json")
    perf_model = load_model(perf_model_path)
    traces = {rate: make_trace("long", args.requests, rate, seed=args.seed, long_fraction=args.long_fraction,
                               short_tokens=short, long_tokens=long, output_tokens=outputs) for rate in rates}
    devices = cluster_devices(on_cuda, args.instances, args.mps, torch.cuda.device_count() if on_cuda else 0)
    extra_args = ["--model", args.model] if args.model else []

    gpu = torch.cuda.get_device_name().replace(" ", "-") if on_cuda else "cpu"
    suffix = result_suffix(gpu if on_cuda else None, args.instances, args.mps)
    out = args.out or ROOT / "bench/results" / f"cluster_multigpu-{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {
        "device": gpu, "machine": platform.node(), "torch": torch.__version__,
        "model": args.model or "SmolLM2-135M-Instruct", "instances": args.instances, "devices": devices,
        "cuda_mps": args.mps, "warm_up_before_rates": args.warm_up,
        "pool_blocks": args.pool_blocks, "block_size": BLOCK_SIZE, "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs, "queue_bypass_limit": args.queue_bypass_limit,
        "split_decode_interval": args.split_decode_interval,
        "perf_model": str(perf_model_path.relative_to(ROOT) if perf_model_path.is_relative_to(ROOT) else perf_model_path),
        "trace": {"requests_per_rate": args.requests, "short_tokens": short, "long_tokens": long,
                  "long_fraction": args.long_fraction, "output_tokens": outputs, "seed": args.seed},
        "perf_model_remote_overhead_s": perf_model.remote_overhead_s,
    }
    results: dict[str, dict] = {}
    warm_ups: dict[str, list] = {}
    prefill_rate = None
    for policy in policies:
        rows, probed = run_policy(policy, args, traces, devices, perf_model_path, extra_args, probe=prefill_rate is None)
        prefill_rate = prefill_rate or probed
        if "warm_up" in rows:
            warm_ups[policy] = rows.pop("warm_up")
        results[policy] = rows
        # Predictions and the report after every policy: a run cut short keeps what it measured.
        remote, single = add_predictions(results, traces, perf_model, args, prefill_rate)
        remote_s = remote[0] if remote else None
        out.write_text(json.dumps({
            **header, "prefill_tokens_per_s": prefill_rate, "remote_wait_per_layer_s": remote_s,
            "remote_serve_per_layer_s": remote[1] if remote else None,
            "policies": {p: {str(rate): row for rate, row in rows.items()} for p, rows in results.items()},
            "single_predicted_only": {str(rate): row for rate, row in single.items()},
            **({"warm_up": warm_ups} if warm_ups else {}),
        }, indent=2) + "\n")

    print_report(json.loads(out.read_text()))
    print(f"-> {out}")


if __name__ == "__main__":
    main()
