"""Decode throughput of `infinited` instances when one request's KV spans 1, 2 or 3 of them,
and the cost of moving KV blocks while it decodes.

Each case starts real daemons (a local cluster), sends one long prompt to instance 1 through
the local API, and times the streamed decode steps (the first event, which carries the
prefill, is left out). Pools are sized so that the request's KV ends up split over the
instances by the home's reactive spill; the placement seen during decode is recorded.

Moves: a leader first moves half of the request's KV to the second instance (at its first
decode step), then sends ``MoveKV`` commands of 1 or 2 blocks (16 or 32 tokens) back to back;
decode throughput after the split is compared with the same request split without the small
moves, so that the cost is the moves' alone (the request all at home is reported beside). The
moves shift attention work to the creditor as the run goes on, so the runs without moves split
the request as the runs with moves do on average: half, plus half of what the warm-up moved.
With ``--move-window STEPS`` the comparison is made within each request instead: windows of
STEPS decode steps alternate without and with moves, and each window with moves is set against
the windows without on either side (the host's drift and the growing split are then shared).
With ``--move-every STEPS`` as well, moves are paced (one each STEPS steps) rather than back to
back: a rate of ``--move-tokens`` per STEPS steps, the measure the goal is set in (tokens a step).

A batch beside a split request (``--batch-beside-split N``, instead of the other cases): N short
requests (``--batch-prompt-tokens`` random ordinary tokens each) start together on the home and
decode ``--batch-new-tokens`` each, alone, and again while one request of ``--context-items``
decodes on the same home with half its KV moved to a second instance (as the cases of moves
split it; it is let go once the batch ends). The batch's step time, from its streamed tokens'
times while all of it decodes, beside the split request over alone, and the split request's
own rate; alternated pairs after a warm-up pair (``--batch-repeats``):

    python bench/daemon.py --device cuda --model /tmp/llama1b --mps --context-items 1700 --new-tokens 512 \
        --max-num-batched-tokens 8192 --batch-beside-split 8 --batch-new-tokens 128

    python bench/daemon.py --device cuda --model /tmp/llama1b --mps --moves-only --context-items 6500 \
        --new-tokens 330 --move-window 18 --move-every 8 --move-tokens 128,256 --move-repeats 3

    python bench/daemon.py                  # the CPU (SmolLM2-135M)
    python bench/daemon.py --device cuda    # one GPU shared by the processes
    python bench/daemon.py --device cuda --spread-gpus --model /tmp/llama1b --context-items 8500 \
        --max-num-batched-tokens 8192          # instance i on GPU i mod count, a 128K-token request

Writes ``bench/results/daemon-<gpu or cpu>.json`` (the batch case: ``...-<K>k-batch<N>.json``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from infinite_llm.daemon.config import parse_cpu_list
from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.messages import Echo, MoveKV

BLOCK_SIZE = 16


def decode_rate(events: list[tuple[float, dict]]) -> tuple[float, int]:
    """Tokens per second over the decode steps (from the first event's arrival to the last)."""
    times = [t for t, e in events if e["token_ids"]]
    tokens = sum(len(e["token_ids"]) for _, e in events[1:])
    return tokens / (times[-1] - times[0]), tokens


def histogram_totals(cluster: LocalCluster) -> dict[int, dict[str, float]]:
    """Per instance, from /metrics: the sums (s), counts and cumulative buckets of the home's
    remote-attention wait and of the creditor's attend serving time."""
    return {inst.inst_id: {name: value for name, value in inst.metrics().items()
                           if name.startswith(("infllm_remote_attention_seconds_", "infllm_attend_serve_seconds_"))}
            for inst in cluster}


def latency_means(before: dict, after: dict) -> dict[int, dict]:
    """Means over what happened between two ``histogram_totals`` (the timed request decoding:
    warm-up, kernel compilation included, is left out), s; and the wait's bucket counts."""
    means: dict[int, dict] = {}
    for inst_id, values in after.items():
        old = before.get(inst_id, {})
        row: dict = {}
        for key in ("remote_attention", "attend_serve"):
            count = values.get(f"infllm_{key}_seconds_count", 0.0) - old.get(f"infllm_{key}_seconds_count", 0.0)
            if count:
                total = values[f"infllm_{key}_seconds_sum"] - old.get(f"infllm_{key}_seconds_sum", 0.0)
                row[f"{key}_mean_s"] = total / count
                row[f"{key}_count"] = int(count)
        buckets = {name.split('le="')[1].rstrip('"}'): int(v - old.get(name, 0.0))
                   for name, v in values.items() if name.startswith("infllm_remote_attention_seconds_bucket")}
        if any(buckets.values()):
            row["remote_attention_cumulative_buckets"] = buckets
        means[inst_id] = row
    return means


# The way of one attend request and its result, in order: (event, process); the wire trace's
# names (``infinite_llm.transport.wire_trace``). Each interval is from one to the next.
ATTEND_PATH = (
    ("attend.start", "home"), ("attend.built", "home"), ("req.encoded", "home"), ("req.posted", "home"),
    ("in.header", "creditor"), ("in.landed", "creditor"),
    ("in.assembled", "creditor"), ("serve.start", "creditor"), ("serve.planned", "creditor"),
    ("serve.launched", "creditor"), ("serve.done", "creditor"), ("in.handled", "creditor"),
    ("reply.encoded", "creditor"), ("reply.posted", "creditor"),
    ("reply.header", "home"), ("reply.landed", "home"), ("reply.set", "home"),
    ("attend.resumed", "home"), ("attend.landed", "home"),
)


def attend_paths(trace_dir: Path) -> tuple[list[dict[str, float]], dict[str, list]]:
    """Each decode attend request of the wire traces of one home and one creditor, as the times
    (perf_counter s) of its ``ATTEND_PATH`` events, in the order sent; and each process's events
    by role ("home", "creditor"). Requests missing an event are left out."""
    processes = []
    for path in sorted(trace_dir.glob("wire-*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        names = {e[1] for e in events}
        processes.append(("home" if "attend.start" in names else "creditor" if "serve.start" in names else None, events))
    home = next((e for role, e in processes if role == "home"), None)
    creditor = next((e for role, e in processes if role == "creditor"), None)
    if home is None or creditor is None:
        return [], {}
    # Each attend request, as the times of its path's events: the home's and the creditor's
    # events follow each other in order within one process; the two join on the message id.
    by_id: dict[int, dict[str, float]] = {}
    current: dict[str, float] = {}
    for t, event, msg_type, msg_id in home:
        if event == "attend.start":
            current = {"attend.start": t}
        elif event == "attend.built" and "attend.start" in current:
            current[event] = t
        elif msg_type == "attend_request" and event in ("req.encoded", "req.posted") and "attend.start" in current:
            current[event] = t
            by_id[msg_id] = current
        elif msg_type == "attend_result" and event.startswith("reply.") and msg_id in by_id:
            current = by_id[msg_id]
            current[event] = t
        elif event in ("attend.resumed", "attend.landed") and current:
            current[event] = t
    serving: dict[str, float] = {}
    for t, event, msg_type, msg_id in creditor:
        if msg_type not in ("attend_request", "attend_result"):
            continue  # the same ids are other senders' messages
        if event == "in.header" and msg_id in by_id:
            serving = by_id[msg_id]
            serving[event] = t
        elif event.startswith("serve.") and serving:
            serving[event] = t
        elif event.startswith(("in.", "reply.")) and by_id.get(msg_id) is serving:
            serving[event] = t
    names = [name for name, _ in ATTEND_PATH]
    complete = sorted((r for r in by_id.values() if all(n in r for n in names)), key=lambda r: r["attend.start"])
    return complete, {"home": home, "creditor": creditor}


def summarise_attends(paths: list[dict[str, float]], within) -> dict:
    """The median and mean (us) of each interval of ``ATTEND_PATH`` over the attend requests
    whose start ``within(t)`` accepts, and of the home's time from a part landing to its next
    attend request (the merge, the rest of the layer and the next layer's projections) where
    both lie within. Means are given beside medians: a rare long stall shows in the mean only."""
    chosen = [r for r in paths if within(r["attend.start"])]
    if not chosen:
        return {}
    names = [name for name, _ in ATTEND_PATH]
    intervals = {f"{a}->{b}": [(r[b] - r[a]) * 1e6 for r in chosen] for a, b in zip(names, names[1:])}
    intervals["total"] = [(r["attend.landed"] - r["attend.start"]) * 1e6 for r in chosen]
    gaps = [(b["attend.start"] - a["attend.landed"]) * 1e6 for a, b in zip(paths, paths[1:])
            if within(a["attend.start"]) and within(b["attend.start"])]
    return {"attend_requests": len(chosen),
            "median_us": {k: statistics.median(v) for k, v in intervals.items()},
            "mean_us": {k: statistics.fmean(v) for k, v in intervals.items()},
            "landed_to_next_request_median_us": statistics.median(gaps) if gaps else None,
            "landed_to_next_request_mean_us": statistics.fmean(gaps) if gaps else None}


def attend_breakdown(trace_dir: Path, since: float) -> dict:
    """Where a decode layer's remote attention goes, from the wire traces of one home and one
    creditor (``summarise_attends``), over the attend requests sent after ``since`` (perf_counter
    s, the same clock as the daemons')."""
    paths, events = attend_paths(trace_dir)
    summary = summarise_attends(paths, lambda t: t > since)
    if not summary:
        return {}
    # Frames of the timed decode that sent a buffer outside their header (UCX then moves it
    # separately: a rendezvous, not a copy inside the header).
    summary["frames_with_separate_buffers"] = {
        role: sum(1 for t, event, msg_type, _ in role_events
                  if event.endswith("separate_buffers") and msg_type.startswith("attend") and t > since)
        for role, role_events in events.items()}
    return summary


def start_py_spy(cluster: LocalCluster, out_dir: Path, seconds: int) -> list[subprocess.Popen]:
    """Sample every instance with py-spy for ``seconds``, native frames too (each sample pauses the
    process briefly: 250 a second)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for inst in cluster:  # every thread of the daemon, what it runs and its CPU time so far
        pid = str(inst.process.pid)
        with (out_dir / f"threads-{inst.inst_id}.txt").open("wb") as f:
            subprocess.run(["ps", "-L", "-o", "tid,comm,pcpu,time", "-p", pid], stdout=f, stderr=subprocess.STDOUT,
                           timeout=30)
            subprocess.run(["py-spy", "dump", "--pid", pid], stdout=f, stderr=subprocess.STDOUT, timeout=30)
    return [subprocess.Popen(["py-spy", "record", "-p", str(inst.process.pid), "-d", str(seconds), "-r", "250",
                              "--native", "-f", "raw", "-o", str(out_dir / f"py-spy-{inst.inst_id}.txt")],
                             stdout=(out_dir / f"py-spy-{inst.inst_id}.log").open("wb"), stderr=subprocess.STDOUT)
            for inst in cluster]


def py_spy_summary(path: Path, top: int = 40) -> dict[str, list[tuple[float, str]]]:
    """Where a py-spy raw profile spent the main thread's samples (the event loop's), as
    (share, frame): by own time (the innermost frame, native ones included) and by inclusive
    time of Python functions (a function counted once per sample however deep it recurs; line
    numbers dropped)."""
    own: dict[str, int] = {}
    inclusive: dict[str, int] = {}
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if not any(f.startswith("<module>") for f in frames):
            continue  # another thread: a progress bar's monitor, an idle executor
        n = int(count)
        total += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for function in {f.rsplit(":", 1)[0] + ")" for f in frames if ".py:" in f}:
            inclusive[function] = inclusive.get(function, 0) + n

    def ranked(counts: dict[str, int]) -> list[tuple[float, str]]:
        return [(n / total, frame) for frame, n in sorted(counts.items(), key=lambda kv: -kv[1])[:top]]

    return {"own": ranked(own), "inclusive": ranked(inclusive)}


def run_request(cluster: LocalCluster, prompt: str, new_tokens: int, placements: list,
                on_decode=None) -> list[tuple[float, dict]]:
    """The request's events with their times; ``on_decode()`` is called once it decodes."""
    events = []
    for event in cluster[1].stream(prompt, max_tokens=new_tokens, ignore_eos=True):
        events.append((time.perf_counter(), event))
        if len(events) == 2:  # decoding: record where the KV lives
            status = cluster[1].status()
            placements.extend(sorted({s["instance_id"] for r in status["requests"] for s in r["segments"]}))
            if on_decode is not None:
                on_decode()
    return events


def core_cpus() -> list[str]:
    """The CPUs of each physical core this process may use (its hardware threads, as a list
    for ``--cpu-affinity``), leaving out CPU 0's core (where the system's own work tends to
    land) when there are others."""
    allowed = os.sched_getaffinity(0)
    cores: list[str] = []
    for cpu in sorted(allowed):
        try:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
        except OSError:
            siblings = str(cpu)
        own = ",".join(str(c) for c in parse_cpu_list(siblings) if c in allowed)
        if own not in cores:
            cores.append(own)
    return cores[1:] if len(cores) > 1 else cores


def cpu_args(instance_cpus: str | None, num_instances: int) -> list[list[str]] | None:
    """Each instance's ``--cpu-affinity`` from ``--instance-cpus`` (None: no pinning)."""
    if instance_cpus is None:
        return None
    if instance_cpus == "auto":
        cpus = core_cpus()
    else:
        cpus = instance_cpus.split(";")
    if len(cpus) < num_instances:
        raise SystemExit(f"--instance-cpus gives CPUs for {len(cpus)} instances, {num_instances} wanted")
    return [["--cpu-affinity", cpus[i]] for i in range(num_instances)]


def instance_devices(device: str, num_instances: int, spread: bool) -> list[str]:
    """Every instance on ``device``, or with ``spread`` instance i on GPU i mod the GPU count."""
    if not spread:
        return [device] * num_instances
    return [f"cuda:{i % torch.cuda.device_count()}" for i in range(num_instances)]


def link_envs(extra_args: list[str], num_instances: int) -> tuple[dict[str, str], list[dict[str, str]] | None]:
    """With ``--nccl-links always``: each daemon a host of its own to NCCL (``NCCL_HOSTID``), so
    that the layers cross NCCL's network transport (sockets on this machine's loopback), as
    between a home and a creditor of another host. (The common env, each instance's own.)"""
    from infinite_llm.transport.nccl_link import loopback_host_env

    if "--nccl-links" not in extra_args or extra_args[extra_args.index("--nccl-links") + 1] != "always":
        return {}, None
    return {}, [loopback_host_env(f"infinite-llm-bench-host-{i}") for i in range(1, num_instances + 1)]


def split_case(num_instances: int, context_blocks: int, prompt: str, new_tokens: int, device: str,
               extra_args: list[str], profile_dir: Path | None = None, spread: bool = False,
               chunk_tokens: int = 128, wire_trace_dir: Path | None = None,
               py_spy: tuple[Path, int] | None = None, instance_cpus: str | None = None) -> dict:
    share = math.ceil(context_blocks / num_instances)
    chunk_blocks = math.ceil(chunk_tokens / BLOCK_SIZE)
    if num_instances == 1:
        pools = [context_blocks + max(64, chunk_blocks)]
    else:
        # The home keeps about one share (plus room for a prefill chunk); each creditor takes a share.
        pools = [share + chunk_blocks + 2] + [share + 4] * (num_instances - 1)
    with tempfile.TemporaryDirectory(prefix="infllm-bench-") as root:
        extra_env = {"INFLLM_PROFILE_DIR": str(profile_dir)} if profile_dir else {}
        if wire_trace_dir is not None:
            extra_env["INFLLM_WIRE_TRACE"] = str(wire_trace_dir)
        link_env, instance_env = link_envs(extra_args, num_instances)
        cluster = LocalCluster(Path(root), num_instances, pools[0], device=device, pool_blocks_per_instance=pools,
                               extra_args=extra_args, extra_env=extra_env | link_env,
                               devices=instance_devices(device, num_instances, spread),
                               instance_args=cpu_args(instance_cpus, num_instances), instance_env=instance_env)
        try:
            cluster.wait_ready()
            run_request(cluster, prompt, 4, [])  # warm-up
            time.sleep(2.5)  # peers republish their freed blocks
            placement: list[int] = []
            before: dict = {}
            # The latencies of decode steps alone: the prompt's chunks attend over many rows.
            decoding_since: list[float] = []

            samplers: list[subprocess.Popen] = []

            def on_decode() -> None:
                decoding_since.append(time.perf_counter())
                before.update(histogram_totals(cluster))
                if py_spy is not None:
                    samplers.extend(start_py_spy(cluster, *py_spy))

            rate, tokens = decode_rate(run_request(cluster, prompt, new_tokens, placement, on_decode=on_decode))
            latencies = latency_means(before, histogram_totals(cluster))
            for sampler in samplers:
                sampler.wait(timeout=py_spy[1] + 60)
            # How the steps went (mailboxes or links, graphs, steps queued ahead, failures).
            step_protocol = {str(i): cluster[i].status().get("step_protocol", {})
                             for i in range(1, num_instances + 1)}
        finally:
            cluster.stop()  # a clean stop: the daemons write their traces
            if os.environ.get("INFLLM_BENCH_LOGS"):  # the daemons' logs kept, for a run to be looked into
                keep = Path(os.environ["INFLLM_BENCH_LOGS"]) / f"split{num_instances}"
                keep.mkdir(parents=True, exist_ok=True)
                for log_path in Path(root).glob("*.log"):
                    shutil.copy(log_path, keep / log_path.name)
    row = {"instances": num_instances, "devices": instance_devices(device, num_instances, spread), "pools": pools,
           "placement": placement, "decode_tokens_per_s": rate,
           "decode_tokens": tokens, "latencies": latencies, "step_protocol": step_protocol}
    if wire_trace_dir is not None and decoding_since:
        row["attend_breakdown"] = attend_breakdown(wire_trace_dir, decoding_since[0])
    if py_spy is not None:
        row["py_spy"] = {path.stem: py_spy_summary(path) for path in sorted(py_spy[0].glob("py-spy-*.txt"))}
        row["threads"] = {path.stem: path.read_text() for path in sorted(py_spy[0].glob("threads-*.txt"))}
    return row


async def leader_moves(address: PeerAddress, req_id_of: "queue.Queue[int]", split_blocks: int, num_blocks: int,
                       ready: threading.Event, stop: threading.Event, dst: int, result: dict,
                       moving: threading.Event | None = None, due: threading.Semaphore | None = None) -> None:
    """A leader's MoveKV commands for the request whose id arrives on ``req_id_of``: first one
    move of ``split_blocks`` (the request then decodes with its KV split, as both timed runs
    do), then, with ``num_blocks``, moves of that many blocks until ``stop``: back to back
    (only while ``moving`` is set, where given), or, with ``due``, one each time the reader of
    the request's steps releases it (a paced rate; a move due while one is under way starts when
    it ends). Its transport is up (``ready``) before the request starts. Sets
    ``result["split_at"]`` (when the split move returned, perf_counter s), ``result["moves"]``
    ((committed, failed)) and ``result["intervals"]`` ((start, end, committed) of each move
    after the split, perf_counter s)."""
    from infinite_llm.transport.ucx import UcxTransport

    transport = UcxTransport(TransportConfig(request_timeout_s=120.0))

    async def nothing(message):
        raise ValueError("the leader serves nothing here")

    await transport.start(nothing)
    await transport.request(address, Echo(torch.zeros(1, dtype=torch.uint8)))  # connected before timing
    ready.set()
    req_id = await asyncio.to_thread(req_id_of.get, True, 600)
    done = failed = 0
    intervals: list[tuple[float, float, bool]] = result.setdefault("intervals", [])
    try:
        await transport.request(address, MoveKV(epoch=1, move_id=1, home_inst_id=1, req_id=req_id, src_inst_id=1,
                                                dst_inst_id=dst, num_blocks=split_blocks))
        result["split_at"] = time.perf_counter()
        move_id = 1
        while num_blocks and not stop.is_set():
            if due is not None and not await asyncio.to_thread(due.acquire, True, 0.05):
                continue
            if moving is not None and not moving.is_set():
                await asyncio.sleep(0.002)
                continue
            move_id += 1
            started = time.perf_counter()
            try:
                await transport.request(address, MoveKV(epoch=1, move_id=move_id, home_inst_id=1, req_id=req_id,
                                                        src_inst_id=1, dst_inst_id=dst, num_blocks=num_blocks))
                done += 1
                intervals.append((started, time.perf_counter(), True))
            except Exception:  # noqa: BLE001  out of lendable blocks near the end: count and go on
                failed += 1
                intervals.append((started, time.perf_counter(), False))
                await asyncio.sleep(0.01)
    finally:
        await transport.close()
        result["moves"] = (done, failed)


def split_run(cluster: LocalCluster, prompt: str, new_tokens: int, split_blocks: int, blocks_per_move: int) -> dict:
    """One request whose KV the leader splits at its first decode step, then (``blocks_per_move``
    > 0) moves back to back; decode rate over the steps after the split."""
    member = json.loads((cluster.state_dir / "members" / "1.json").read_text())
    address = PeerAddress(member["peer_host"], member["peer_port"])
    events: list[tuple[float, dict]] = []
    ready, stop = threading.Event(), threading.Event()
    req_id_of: queue.Queue[int] = queue.Queue()
    result: dict = {}
    leader_thread = threading.Thread(target=lambda: asyncio.run(leader_moves(
        address, req_id_of, split_blocks, blocks_per_move, ready, stop, dst=2, result=result)))
    leader_thread.start()
    creditor_before = creditor_counts(cluster[2])
    try:
        if not ready.wait(120):
            raise RuntimeError("the benchmark's leader transport did not start")
        for event in cluster[1].stream(prompt, max_tokens=new_tokens, ignore_eos=True):
            events.append((time.perf_counter(), event))
            if len(events) == 1:
                req_id_of.put(int(event["request_id"]))
    finally:  # the leader's thread ends whatever became of the request
        stop.set()
        leader_thread.join(timeout=120)
    if "split_at" not in result:
        raise RuntimeError("the split move did not return before the request ended")
    after = [(t, e) for t, e in events if t > result["split_at"]]
    if len(after) < 3:
        raise RuntimeError(f"only {len(after)} steps after the split: ask for more new tokens")
    rate, tokens = decode_rate(after)
    done, failed = result["moves"]
    creditor = {name: count - creditor_before[name] for name, count in creditor_counts(cluster[2]).items()}
    return {"tokens_per_s": rate, "steps": tokens, "moves_committed": done, "moves_failed": failed,
            "creditor": creditor}


def toggled_run(cluster: LocalCluster, prompt: str, new_tokens: int, split_blocks: int, blocks_per_move: int,
                window_steps: int, skip_steps: int, move_every: int = 0) -> dict:
    """One request whose KV the leader splits at its first decode step; then windows of
    ``window_steps`` decode steps alternate, without moves first, with moves next: back to
    back, or with ``move_every`` one move each ``move_every`` steps, the first at the window's
    first measured step (a paced rate of ``blocks_per_move`` blocks per ``move_every`` steps,
    each move's steps inside the measured ones). Each window's rate leaves out its first
    ``skip_steps``. Windows with and without moves thus share the request, its split as it
    grows and the host's state at the time: their difference is the moves' cost with the drifts
    of separate runs taken out.

    A window is marked ``clean`` when its measured steps are what it claims: without moves, no
    move ran during them (one started in the window before may run on); with moves, none failed.
    """
    member = json.loads((cluster.state_dir / "members" / "1.json").read_text())
    address = PeerAddress(member["peer_host"], member["peer_port"])
    times: list[float] = []
    ready, stop, moving = threading.Event(), threading.Event(), threading.Event()
    due = threading.Semaphore(0) if move_every else None
    req_id_of: queue.Queue[int] = queue.Queue()
    result: dict = {}
    leader_thread = threading.Thread(target=lambda: asyncio.run(leader_moves(
        address, req_id_of, split_blocks, blocks_per_move, ready, stop, dst=2, result=result, moving=moving,
        due=due)))
    leader_thread.start()
    first_after_split = None
    try:
        if not ready.wait(120):
            raise RuntimeError("the benchmark's leader transport did not start")
        for event in cluster[1].stream(prompt, max_tokens=new_tokens, ignore_eos=True):
            now = time.perf_counter()
            if not times:
                req_id_of.put(int(event["request_id"]))
            times.append(now)
            if first_after_split is None and "split_at" in result and now > result["split_at"]:
                first_after_split = len(times) - 1
            if first_after_split is not None:
                step = len(times) - 1 - first_after_split
                in_moving_window = step // window_steps % 2 == 1
                if in_moving_window:
                    moving.set()
                else:
                    moving.clear()
                # A step seen here has ended: the move ordered now runs in the steps after it,
                # which for the first at step ``skip_steps`` are the window's measured ones.
                if due is not None and in_moving_window and step % window_steps >= skip_steps \
                        and (step % window_steps - skip_steps) % move_every == 0:
                    due.release()
    finally:
        stop.set()
        leader_thread.join(timeout=120)
    if first_after_split is None:
        raise RuntimeError("the split move did not return before the request ended")
    after = times[first_after_split:]
    intervals = result["intervals"]
    windows = []
    for w in range((len(after) - 1) // window_steps):  # windows whose last step was seen
        start, end = w * window_steps + skip_steps, (w + 1) * window_steps
        t0, t1 = after[start], after[end]
        overlapping = [ok for began, ended, ok in intervals if began < t1 and ended > t0]
        with_moves = bool(w % 2)
        windows.append({"moves": with_moves, "tokens_per_s": (end - start) / (t1 - t0), "t0": t0, "t1": t1,
                        "moves_committed": sum(1 for began, _, ok in intervals
                                               if ok and after[w * window_steps] <= began < t1),
                        "clean": all(overlapping) if with_moves else not overlapping})
    done, failed = result["moves"]
    return {"windows": windows, "moves_committed": done, "moves_failed": failed,
            "move_seconds": [ended - began for began, ended, ok in intervals if ok]}


def compared_windows(windows: list[dict]) -> list[tuple[dict, dict, dict]]:
    """(before, with moves, after) for each clean window with moves between two clean windows
    without (windows alternate, so its neighbours are without)."""
    return [(windows[i - 1], windows[i], windows[i + 1]) for i in range(1, len(windows) - 1)
            if windows[i]["moves"] and all(w["clean"] for w in windows[i - 1:i + 2])]


def window_costs(windows: list[dict]) -> list[float]:
    """Each compared window with moves against the mean rate of its neighbours without:
    1 - its rate / that mean."""
    return [1 - w["tokens_per_s"] / ((before["tokens_per_s"] + after["tokens_per_s"]) / 2)
            for before, w, after in compared_windows(windows)]


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (nan for fewer than two values)."""
    if not values:
        return float("nan"), float("nan")
    error = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return statistics.fmean(values), error


def creditor_counts(inst) -> dict[str, float]:
    """What the instance's creditor did so far: plans made new or retargeted, graph replays and
    captures, attend requests served."""
    metrics = inst.metrics()
    return {"plans_new": metrics.get('infllm_attend_plans_total{kind="new"}', 0.0),
            "plans_retargeted": metrics.get('infllm_attend_plans_total{kind="retargeted"}', 0.0),
            "graph_replays": metrics.get("infllm_attend_graph_replays_total", 0.0),
            "graph_captures": metrics.get("infllm_attend_graph_captures_total", 0.0),
            "attend_served": metrics.get("infllm_attend_serve_seconds_count", 0.0)}


@contextlib.contextmanager
def move_cluster(context_blocks: int, prompt: str, new_tokens: int, device: str, extra_args: list[str],
                 spread: bool, chunk_blocks: int, instance_cpus: str | None, extra_env: dict[str, str] | None = None,
                 home_extra_blocks: int = 0):
    """Two instances for the cases of moves (the home with room for the whole request, and
    ``home_extra_blocks`` more, the peer for its moved KV), warmed up; yields the cluster and
    the request's decode rate all at home, and stops the cluster after."""
    pools = [context_blocks + 64 + chunk_blocks + home_extra_blocks, context_blocks + 64]
    with tempfile.TemporaryDirectory(prefix="infllm-bench-") as root:
        link_env, instance_env = link_envs(extra_args, 2)
        cluster = LocalCluster(Path(root), 2, pools[0], device=device, pool_blocks_per_instance=pools,
                               extra_args=extra_args, extra_env=(extra_env or {}) | link_env,
                               devices=instance_devices(device, 2, spread),
                               instance_args=cpu_args(instance_cpus, 2), instance_env=instance_env)
        try:
            cluster.wait_ready()
            run_request(cluster, prompt, 4, [])  # warm-up
            local, _ = decode_rate(run_request(cluster, prompt, new_tokens, []))
            yield cluster, local
        finally:
            cluster.stop()


def toggled_move_case(context_blocks: int, prompt: str, new_tokens: int, blocks_per_move: int, device: str,
                      extra_args: list[str], spread: bool, chunk_blocks: int, instance_cpus: str | None,
                      repeats: int, window_steps: int, skip_steps: int, wire_trace_dir: Path | None = None,
                      move_every: int = 0) -> dict:
    """The moves' cost from ``repeats`` requests each alternating windows without and with
    moves (``toggled_run``; ``move_every``: paced, one move each that many steps, 0: back to
    back), after a warm-up request that does the same. The cost is the mean
    over the compared windows of all requests; its standard error is taken over the requests'
    own means (windows of one request share neighbours and the request's state, so they are
    not independent), and over the windows beside it. With ``wire_trace_dir``, the daemons
    trace their messages there, and where the decode layers' remote attention goes is reported
    for the measured steps of the compared windows with moves and of their neighbours without."""
    split_blocks = context_blocks // 2
    runs = []
    extra_env = {"INFLLM_WIRE_TRACE": str(wire_trace_dir)} if wire_trace_dir is not None else None
    with move_cluster(context_blocks, prompt, new_tokens, device, extra_args, spread, chunk_blocks,
                      instance_cpus, extra_env) as (cluster, local):
        for i in range(repeats + 1):  # the first compiles and captures what a split uses
            time.sleep(2.5)  # the creditor frees the last request's segments
            run = toggled_run(cluster, prompt, new_tokens, split_blocks, blocks_per_move, window_steps, skip_steps,
                              move_every)
            if i:
                runs.append(run)
    per_run = [window_costs(run["windows"]) for run in runs]
    pooled = [c for costs in per_run for c in costs]
    cost, error_windows = mean_and_error(pooled)
    _, error_requests = mean_and_error([statistics.fmean(costs) for costs in per_run if costs])
    compared = [w for run in runs for _, w, _ in compared_windows(run["windows"])]
    breakdown = {}
    if wire_trace_dir is not None:
        paths, _ = attend_paths(wire_trace_dir)
        neighbours = [w for run in runs for before, _, after in compared_windows(run["windows"]) for w in (before, after)]
        for name, windows in (("with_moves", compared), ("without_moves", neighbours)):
            spans = sorted({(w["t0"], w["t1"]) for w in windows})
            breakdown[name] = summarise_attends(paths, lambda t, spans=spans: any(t0 <= t < t1 for t0, t1 in spans))
    measured_steps = len(compared) * (window_steps - skip_steps)
    move_seconds = [s for run in runs for s in run["move_seconds"]]
    return {"tokens_per_move": blocks_per_move * BLOCK_SIZE, "split_blocks": split_blocks, "repeats": repeats,
            "design": "toggled windows", "window_steps": window_steps, "skip_steps": skip_steps,
            "pacing": f"one move each {move_every} steps" if move_every else "back to back",
            "move_every_steps": move_every,
            "tokens_moved_per_measured_step": (sum(w["moves_committed"] for w in compared) * blocks_per_move
                                               * BLOCK_SIZE / max(1, measured_steps)),
            "move_seconds_mean": statistics.fmean(move_seconds) if move_seconds else None,
            "decode_tokens_per_s_local": local,
            "throughput_cost": cost, "standard_error": error_requests, "standard_error_over_windows": error_windows,
            "windows_compared": len(pooled),
            "windows_left_out": sum(1 for run in runs for w in run["windows"] if not w["clean"]),
            "per_run_cost": [statistics.fmean(costs) if costs else None for costs in per_run],
            "runs_windows": [run["windows"] for run in runs],
            "moves_committed": sum(r["moves_committed"] for r in runs),
            "moves_failed": sum(r["moves_failed"] for r in runs),
            "moves_per_step_in_compared_windows": (sum(w["moves_committed"] for w in compared)
                                                   / max(1, len(compared) * window_steps)),
            **({"attend_breakdown": breakdown} if breakdown else {})}


def move_case(context_blocks: int, prompt: str, new_tokens: int, blocks_per_move: int, device: str,
              extra_args: list[str], spread: bool = False, chunk_blocks: int = 8,
              instance_cpus: str | None = None, repeats: int = 1) -> dict:
    """Decode with the request's KV split, without and with moves back to back (``repeats``
    pairs, alternated on one cluster): the cost of the moves alone, from the sums of the rates.
    With moves the split starts half and half and the creditor's share grows; without, the split
    is the mean of that (from the warm-up's moves). (The request alone, all at home, is
    reported beside.)"""
    split_blocks = context_blocks // 2
    without, moving = [], []
    with move_cluster(context_blocks, prompt, new_tokens, device, extra_args, spread, chunk_blocks,
                      instance_cpus) as (cluster, local):
        # The first split request compiles and captures what only a split uses (the home's
        # merge, the creditor's kernels and graphs): a warm-up too, with its moves.
        time.sleep(2.5)
        warm = split_run(cluster, prompt, new_tokens, split_blocks, blocks_per_move)
        mean_split_blocks = split_blocks + round(warm["moves_committed"] * blocks_per_move / 2)
        for _ in range(repeats):
            time.sleep(2.5)  # the creditor frees the last request's segments
            without.append(split_run(cluster, prompt, new_tokens, mean_split_blocks, 0))
            time.sleep(2.5)
            moving.append(split_run(cluster, prompt, new_tokens, split_blocks, blocks_per_move))
    rate_without = sum(r["tokens_per_s"] for r in without) / repeats
    rate_with = sum(r["tokens_per_s"] for r in moving) / repeats
    committed = sum(r["moves_committed"] for r in moving)
    steps = sum(r["steps"] for r in moving)
    # What the runs with moves split on average, to set beside the warm-up's estimate above.
    mean_split_blocks_with = split_blocks + committed * blocks_per_move / (2 * repeats)
    return {"tokens_per_move": blocks_per_move * BLOCK_SIZE, "split_blocks": split_blocks,
            "split_blocks_without": mean_split_blocks, "mean_split_blocks_with": mean_split_blocks_with,
            "repeats": repeats,
            "decode_tokens_per_s_local": local, "decode_tokens_per_s_without": rate_without,
            "decode_tokens_per_s_with": rate_with, "throughput_cost": 1 - rate_with / rate_without,
            "runs_tokens_per_s_without": [r["tokens_per_s"] for r in without],
            "runs_tokens_per_s_with": [r["tokens_per_s"] for r in moving],
            "moves_committed": committed, "moves_failed": sum(r["moves_failed"] for r in moving),
            "decode_steps": steps, "moves_per_step": committed / max(1, steps),
            "creditor_without": {k: sum(r["creditor"][k] for r in without) for k in without[0]["creditor"]},
            "creditor_with": {k: sum(r["creditor"][k] for r in moving) for k in moving[0]["creditor"]}}


# Ordinary tokens in every Llama-family vocabulary (SmolLM2's and Llama 3's), for the prompts of
# the batch beside a split request (as ``bench/cluster_multigpu.py`` draws its prompts).
TOKEN_ID_RANGE = (1000, 30000)


def token_prompts(count: int, tokens: int, seed: int = 0) -> list[list[int]]:
    """``count`` distinct prompts of ``tokens`` random ordinary token ids, the same for a seed."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(*TOKEN_ID_RANGE, (tokens,), generator=generator).tolist() for _ in range(count)]


def batch_steps(streams: list[list[tuple[float, dict]]], until: float | None = None) -> dict:
    """The decode steps a batch of requests saw while all of them decoded: from the last of
    their first tokens (the prefill's) to the first of their last (or ``until``, if earlier).
    Per request, its steps are the events with tokens in that window; its step time the
    window's span of them over their count less one. Reports the mean step over requests,
    the median of every step, the batch's tokens per second (the sum of the requests' rates)
    and the fewest steps a request had in the window."""
    times = [[t for t, e in events if e["token_ids"]] for events in streams]
    if not all(times):
        raise RuntimeError("a request of the batch made no token")
    t0, t1 = max(ts[0] for ts in times), min(ts[-1] for ts in times)
    if until is not None:
        t1 = min(t1, until)
    spans, intervals, rate = [], [], 0.0
    steps = []
    for events in streams:
        inside = [(t, len(e["token_ids"])) for t, e in events if e["token_ids"] and t0 <= t <= t1]
        if len(inside) < 3:
            raise RuntimeError(f"a request of the batch had {len(inside)} steps while the others decoded: ask for "
                               "more --batch-new-tokens (and --new-tokens for the split request)")
        span = inside[-1][0] - inside[0][0]
        spans.append(span / (len(inside) - 1))
        intervals += [b[0] - a[0] for a, b in zip(inside, inside[1:])]
        rate += sum(n for _, n in inside[1:]) / span
        steps.append(len(inside) - 1)
    return {"step_s": statistics.fmean(spans), "step_median_s": statistics.median(intervals),
            "tokens_per_s": rate, "steps": min(steps), "window_s": t1 - t0, "window": (t0, t1)}


def placements(inst) -> dict[int, list[int]]:
    """Where each request of the instance's own has its KV: {request id: sorted instance ids}."""
    return {int(r["request_id"]): sorted({s["instance_id"] for s in r["segments"]})
            for r in inst.status()["requests"]}


def batch_run(cluster: LocalCluster, prompts: list[list[int]], new_tokens: int, long_prompt: str | None = None,
              long_new_tokens: int = 0, split_blocks: int = 0) -> dict:
    """A batch of requests (``prompts``, ``new_tokens`` each) started together on instance 1 and
    decoding concurrently; with ``long_prompt``, while that request decodes with its KV split:
    a leader moves ``split_blocks`` of it to instance 2 at its first decode step (as the cases
    of moves split a request), the batch starts once the move has returned, and the long
    request is let go (its stream closed: the daemon cancels it) once the batch has ended. Its
    ``long_new_tokens`` must outlast the batch. The batch's steps (``batch_steps``), counted
    only while the long request decoded; the long request's own rate, over the batch's window
    and over all its steps after the split; and where every request's KV was once the batch
    decoded."""
    errors: list[BaseException] = []
    streams: list[list[tuple[float, dict]]] = [[] for _ in prompts]

    def stream(prompt: list[int], events: list) -> None:
        try:
            for event in cluster[1].stream(prompt, max_tokens=new_tokens, ignore_eos=True):
                events.append((time.perf_counter(), event))
        except BaseException as exc:  # noqa: BLE001  raised by the caller's thread below
            errors.append(exc)

    long_events: list[tuple[float, dict]] = []
    let_go = threading.Event()
    result: dict = {}
    long_thread = leader_thread = None
    if long_prompt is not None:
        member = json.loads((cluster.state_dir / "members" / "1.json").read_text())
        address = PeerAddress(member["peer_host"], member["peer_port"])
        ready, stop = threading.Event(), threading.Event()
        req_id_of: queue.Queue[int] = queue.Queue()
        leader_thread = threading.Thread(target=lambda: asyncio.run(leader_moves(
            address, req_id_of, split_blocks, 0, ready, stop, dst=2, result=result)))
        leader_thread.start()

        def stream_long() -> None:
            events = cluster[1].stream(long_prompt, max_tokens=long_new_tokens, ignore_eos=True)
            try:
                for event in events:
                    long_events.append((time.perf_counter(), event))
                    if len(long_events) == 1:
                        req_id_of.put(int(event["request_id"]))
                    if let_go.is_set():
                        break
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                if not long_events:
                    req_id_of.put(-1)  # the leader waits no longer: its move of no request fails
            finally:
                events.close()  # the connection closes: the daemon cancels the request

        try:
            if not ready.wait(120):
                raise RuntimeError("the benchmark's leader transport did not start")
            long_thread = threading.Thread(target=stream_long, daemon=True)
            long_thread.start()
            leader_thread.join(timeout=600)  # it ends once the split move has returned
        finally:
            stop.set()
            if leader_thread.is_alive():
                leader_thread.join(timeout=120)
        if "split_at" not in result:
            let_go.set()
            raise RuntimeError(f"the split move did not return ({errors or 'see the leader thread above'})")
    protocol_before = {i: cluster[i].status().get("step_protocol", {}) for i in cluster.instances}
    threads = [threading.Thread(target=stream, args=(p, events), daemon=True) for p, events in zip(prompts, streams)]
    for thread in threads:
        thread.start()
    where: dict[int, list[int]] = {}
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and not errors and any(t.is_alive() for t in threads):
            if all(sum(1 for _, e in events if e["token_ids"]) >= 2 for events in streams):
                where = placements(cluster[1])  # every request of the batch decodes
                break
            time.sleep(0.005)
        for thread in threads:
            thread.join(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        let_go.set()
        if long_thread is not None:
            long_thread.join(timeout=120)
    if errors:
        raise RuntimeError(f"a request of the batch failed: {errors[0]!r}") from errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("the batch's requests did not end within 600 s")
    row: dict = {}
    if long_prompt is not None:
        after = [(t, e) for t, e in long_events if t > result["split_at"] and e["token_ids"]]
        if len(after) < 3:
            raise RuntimeError(f"only {len(after)} steps of the split request after its split: ask for more --new-tokens")
        long_end = after[-1][0]
        row["split_request_outlasted_batch"] = long_end >= min(events[-1][0] for events in streams)
        row.update(batch_steps(streams, until=long_end))
        t0, t1 = row["window"]
        inside = [t for t, _ in after if t0 <= t <= t1]
        row["split_request_tokens_per_s"] = (len(inside) - 1) / (inside[-1] - inside[0]) if len(inside) > 2 else None
        row["split_request_tokens_per_s_after_split"], row["split_request_steps_after_split"] = decode_rate(after)
        long_id = int(long_events[0][1]["request_id"])
        row["split_request_placement"] = where.get(long_id)
        where.pop(long_id, None)
    else:
        row.update(batch_steps(streams))
    row["batch_placements"] = sorted({tuple(v) for v in where.values()})
    # What the step protocol counted over the run, per instance (the counters that grew): how
    # many of the home's steps went as one graph, and what its creditors did meanwhile.
    row["step_protocol"] = {}
    for i, before in protocol_before.items():
        after = cluster[i].status().get("step_protocol", {})
        row["step_protocol"][str(i)] = {k: v - before.get(k, 0) for k, v in after.items()
                                        if isinstance(v, int) and not isinstance(v, bool) and v != before.get(k, 0)}
    del row["window"]
    return row


def batch_beside_split_case(context_blocks: int, prompt: str, new_tokens: int, batch: int, batch_prompt_tokens: int,
                            batch_new_tokens: int, device: str, extra_args: list[str], spread: bool,
                            chunk_blocks: int, instance_cpus: str | None, repeats: int) -> dict:
    """A batch of ``batch`` short requests on the home, decoding alone against decoding beside
    one long request whose KV is split half and half over the home and a second instance
    (``batch_run``). Two instances, the home with room for the long request and the batch (so
    nothing spills); the long request alone, all at home, is timed first (``move_cluster``).
    A warm-up pair (compiling and capturing the batch's sizes and the split path), then
    ``repeats`` pairs, the order within a pair alternated (alone first, then beside first).
    The cost is the ratio of the mean step times, beside over alone; each pair's is given too."""
    short_blocks = math.ceil((batch_prompt_tokens + batch_new_tokens) / BLOCK_SIZE) + 1
    prompts = token_prompts(batch, batch_prompt_tokens)
    split_blocks = context_blocks // 2
    alone, beside, warm = [], [], {}
    with move_cluster(context_blocks, prompt, new_tokens, device, extra_args, spread, chunk_blocks, instance_cpus,
                      home_extra_blocks=batch * short_blocks) as (cluster, local):
        pools = [context_blocks + 64 + chunk_blocks + batch * short_blocks, context_blocks + 64]
        for i in range(repeats + 1):
            pair = {}
            for kind in (("alone", "beside") if i % 2 == 0 else ("beside", "alone")):
                time.sleep(2.5)  # the creditor frees the last request's segments
                pair[kind] = (batch_run(cluster, prompts, batch_new_tokens) if kind == "alone" else
                              batch_run(cluster, prompts, batch_new_tokens, prompt, new_tokens, split_blocks))
            if i:
                alone.append(pair["alone"])
                beside.append(pair["beside"])
            else:
                warm = pair
    step_alone = statistics.fmean(r["step_s"] for r in alone)
    step_beside = statistics.fmean(r["step_s"] for r in beside)
    split_rates = [r["split_request_tokens_per_s"] for r in beside if r["split_request_tokens_per_s"]]
    return {"batch": batch, "batch_prompt_tokens": batch_prompt_tokens, "batch_new_tokens": batch_new_tokens,
            "split_blocks": split_blocks, "pools": pools, "devices": instance_devices(device, 2, spread),
            "repeats": repeats,
            "step_s_alone": step_alone, "step_s_beside_split": step_beside,
            "step_ratio": step_beside / step_alone,
            "step_median_s_alone": statistics.median(r["step_median_s"] for r in alone),
            "step_median_s_beside_split": statistics.median(r["step_median_s"] for r in beside),
            "batch_tokens_per_s_alone": statistics.fmean(r["tokens_per_s"] for r in alone),
            "batch_tokens_per_s_beside_split": statistics.fmean(r["tokens_per_s"] for r in beside),
            "pair_step_ratios": [b["step_s"] / a["step_s"] for a, b in zip(alone, beside)],
            "split_request_tokens_per_s": statistics.fmean(split_rates) if split_rates else None,
            "split_request_tokens_per_s_after_split": statistics.fmean(
                r["split_request_tokens_per_s_after_split"] for r in beside),
            "split_request_tokens_per_s_local": local,
            "runs_alone": alone, "runs_beside_split": beside, "warm_up": warm}


def batch_main(args, context_blocks: int, prompt: str, extra_args: list[str]) -> None:
    """``--batch-beside-split``: the batch case alone, its report in
    ``daemon-<gpu>[...]-batch<N>.json`` (the other cases' header, their lists empty)."""
    if args.batch_beside_split < 1 or args.batch_repeats < 1:
        raise SystemExit("--batch-beside-split and --batch-repeats must be at least 1")
    # A `timeout` that ends the run stops the daemons too (they run in sessions of their own).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    case = batch_beside_split_case(context_blocks, prompt, args.new_tokens, args.batch_beside_split,
                                   args.batch_prompt_tokens, args.batch_new_tokens, args.device, extra_args,
                                   args.spread_gpus, math.ceil((args.max_num_batched_tokens or 128) / BLOCK_SIZE),
                                   args.instance_cpus, args.batch_repeats)
    gpu = torch.cuda.get_device_name().replace(" ", "-") if args.device.startswith("cuda") else "cpu"
    report = {"device": gpu, "machine": platform.node(), "instance_cpus": args.instance_cpus, "torch": torch.__version__,
              "model": args.model or "SmolLM2-135M-Instruct", "cuda_mps": args.mps,
              "remote_attention": args.remote_attention or "auto",
              "steps_ahead": args.steps_ahead if args.steps_ahead is not None else 1,
              "split_decode_interval": args.split_decode_interval if args.split_decode_interval is not None else 1,
              "spread_gpus": args.spread_gpus, "peer_spin_s": args.peer_spin_s,
              "peer_header_ring_bytes": args.peer_header_ring_bytes, "context_blocks": context_blocks,
              "new_tokens": args.new_tokens, "max_num_batched_tokens": args.max_num_batched_tokens or 128,
              "splits": [], "moves": [], "batch_beside_split": case}
    suffix = (f"-{Path(args.model).name}" if args.model else "") + ("-mps" if args.mps else "")
    suffix += f"-x{torch.cuda.device_count()}" if args.spread_gpus else ""
    suffix += f"-{args.remote_attention}" if args.remote_attention else ""
    suffix += f"-ahead{args.steps_ahead}" if args.steps_ahead is not None else ""
    suffix += f"-links-{args.nccl_links}" if args.nccl_links is not None else ""
    suffix += f"-interval{args.split_decode_interval}" if args.split_decode_interval is not None else ""
    suffix += "-pinned" if args.instance_cpus else ""
    suffix += f"-{max(1, round(context_blocks * BLOCK_SIZE / 1024))}k-batch{args.batch_beside_split}"
    out = Path(args.out_dir) / f"daemon-{gpu}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    c = case
    print(f"{c['batch']} requests of {c['batch_prompt_tokens']} prompt tokens on the home, decoding "
          f"{c['batch_new_tokens']} tokens; beside them one request of {context_blocks * BLOCK_SIZE} tokens' room, "
          f"{c['split_blocks']} of its blocks moved to the second instance")
    print(f"{'':>14} {'step ms':>8} {'median ms':>9} {'batch tok/s':>11}")
    for name, key in (("alone", "alone"), ("beside split", "beside_split")):
        print(f"{name:>14} {1e3 * c[f'step_s_{key}']:>8.2f} {1e3 * c[f'step_median_s_{key}']:>9.2f} "
              f"{c[f'batch_tokens_per_s_{key}']:>11.1f}")
    print(f"step ratio beside / alone {c['step_ratio']:.3f} (pairs {[round(r, 3) for r in c['pair_step_ratios']]}); "
          f"split request {c['split_request_tokens_per_s'] or float('nan'):.1f} tok/s beside the batch "
          f"({c['split_request_tokens_per_s_after_split']:.1f} over all its steps after the split), "
          f"{c['split_request_tokens_per_s_local']:.1f} tok/s alone at home")
    print(f"placements: batch {[r['batch_placements'] for r in c['runs_beside_split']]}, split request "
          f"{[r['split_request_placement'] for r in c['runs_beside_split']]}")
    print(f"-> {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--context-items", type=int, default=130, help="passkey items (16.5-19 tokens each)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    parser.add_argument("--profile-dir", type=Path, default=None,
                        help="profile the daemons of the two-instance case (cProfile) and print where time goes")
    parser.add_argument("--wire-trace", action="store_true",
                        help="trace the messages of the two-instance case and of the windowed cases of moves "
                             "(INFLLM_WIRE_TRACE) and report where a decode layer's remote attention goes")
    parser.add_argument("--py-spy", type=int, default=None, metavar="SECONDS",
                        help="sample the two-instance case's daemons with py-spy for SECONDS once the request "
                             "decodes (ask for enough new tokens) and report where their time goes")
    parser.add_argument("--peer-spin-s", type=float, default=None,
                        help="the instances' --peer-spin-s (default theirs: 0.02 s on a GPU, 0.0005 s on the CPU)")
    parser.add_argument("--peer-header-ring-bytes", type=int, default=None,
                        help="the instances' --peer-header-ring-bytes (default theirs, 2 MiB; 0: headers over UCX)")
    parser.add_argument("--mps", action="store_true",
                        help="record that the processes share the GPU through CUDA MPS (started by the caller)")
    parser.add_argument("--spread-gpus", action="store_true", help="instance i on GPU i mod the GPU count")
    parser.add_argument("--instances", default="1,2,3", help="the split cases, comma-separated")
    parser.add_argument("--no-moves", action="store_true", help="skip the cases of moves during decode")
    parser.add_argument("--moves-only", action="store_true", help="only the cases of moves during decode")
    parser.add_argument("--move-repeats", type=int, default=1,
                        help="runs without and with moves, alternated, per case of moves")
    parser.add_argument("--move-tokens", default="16,32", help="the cases of moves: tokens a move, comma-separated")
    parser.add_argument("--move-window", type=int, default=0, metavar="STEPS",
                        help="instead of separate runs with and without moves, alternate windows of STEPS decode "
                             "steps without and with moves within each request (--move-repeats requests)")
    parser.add_argument("--move-window-skip", type=int, default=2, metavar="STEPS",
                        help="steps at the start of each window left out of its rate")
    parser.add_argument("--move-every", type=int, default=0, metavar="STEPS",
                        help="with --move-window: one move each STEPS decode steps (a rate of --move-tokens per "
                             "STEPS steps), the first at a window's first measured step; it must divide the "
                             "window's measured steps. 0: moves back to back")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="the instances' prefill chunk (default: the local cluster's)")
    parser.add_argument("--model", default=None,
                        help="GGUF file or Hugging Face folder (default: the embedded SmolLM2-135M)")
    parser.add_argument("--instance-cpus", default=None,
                        help='each instance on CPUs of its own: "auto" (one CPU per physical core, CPU 0 left '
                             'out) or lists per instance separated by ";" ("2;4-5")')
    parser.add_argument("--creditor-cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="the instances' setting (default: theirs, on)")
    parser.add_argument("--remote-attention", choices=("auto", "mailboxes", "messages"), default=None,
                        help="the instances' setting (default: theirs, auto: mailboxes on a GPU)")
    parser.add_argument("--nccl-links", choices=("auto", "always", "never"), default=None,
                        help="the daemons' --nccl-links; always: every creditor by an NCCL link, each daemon "
                             "a host of its own to NCCL (as between hosts, over the loopback)")
    parser.add_argument("--steps-ahead", type=int, choices=(0, 1), default=None,
                        help="the instances' setting (default: theirs, 1)")
    parser.add_argument("--split-decode-interval", type=int, default=None,
                        help="the instances' setting (default: theirs, 1)")
    parser.add_argument("--batch-beside-split", type=int, default=0, metavar="N",
                        help="instead of the other cases: N short requests decoding on the home alone, against "
                             "the same beside one request (of --context-items, up to --new-tokens, let go once "
                             "the batch ends) whose KV is split over the home and a second instance (0: off)")
    parser.add_argument("--batch-prompt-tokens", type=int, default=256, help="the batch's prompts, tokens each")
    parser.add_argument("--batch-new-tokens", type=int, default=64, help="the batch's new tokens, each")
    parser.add_argument("--batch-repeats", type=int, default=2,
                        help="pairs of runs alone and beside the split request, after a warm-up pair")
    args = parser.parse_args()
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if args.device == "cpu":
        os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    prompt = passkey_prompt(args.context_items)
    # Tokens are 16.5-19 per item (SmolLM2's tokenizer; more as the numbers grow) plus the question; blocks with room for the output.
    context_blocks = math.ceil((19 * args.context_items + 40 + args.new_tokens) / BLOCK_SIZE)

    extra_args = (["--model", args.model] if args.model else [])
    extra_args += ["--peer-spin-s", str(args.peer_spin_s)] if args.peer_spin_s is not None else []
    extra_args += (["--peer-header-ring-bytes", str(args.peer_header_ring_bytes)]
                   if args.peer_header_ring_bytes is not None else [])
    if args.max_num_batched_tokens:
        extra_args += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.creditor_cuda_graphs is not None:
        extra_args += ["--creditor-cuda-graphs" if args.creditor_cuda_graphs else "--no-creditor-cuda-graphs"]
    if args.remote_attention is not None:
        extra_args += ["--remote-attention", args.remote_attention]
    if args.steps_ahead is not None:
        extra_args += ["--steps-ahead", str(args.steps_ahead)]
    if args.nccl_links is not None:
        extra_args += ["--nccl-links", args.nccl_links]
    if args.split_decode_interval is not None:
        extra_args += ["--split-decode-interval", str(args.split_decode_interval)]
    if args.batch_beside_split:
        batch_main(args, context_blocks, prompt, extra_args)
        return
    counts = [] if args.moves_only else [int(n) for n in args.instances.split(",")]
    move_blocks = []
    for tokens in args.move_tokens.split(","):
        if int(tokens) <= 0 or int(tokens) % BLOCK_SIZE:
            raise SystemExit(f"--move-tokens: {tokens} is not a positive multiple of the block size ({BLOCK_SIZE})")
        move_blocks.append(int(tokens) // BLOCK_SIZE)
    if args.move_repeats < 1:
        raise SystemExit("--move-repeats must be at least 1")
    if args.move_window < 0 or (args.move_window and not 0 <= args.move_window_skip < args.move_window):
        raise SystemExit("--move-window must be at least 0, and --move-window-skip at least 0 and less than it")
    if args.move_every < 0 or (args.move_every and (
            not args.move_window or (args.move_window - args.move_window_skip) % args.move_every)):
        raise SystemExit("--move-every needs --move-window, and must divide the window's measured steps "
                         "(--move-window minus --move-window-skip)")
    if counts and counts[0] != 1:
        raise SystemExit("--instances must start with 1 (the anchor)")
    splits = [split_case(n, context_blocks, prompt, args.new_tokens, args.device, extra_args,
                         args.profile_dir if n == 2 else None, args.spread_gpus,
                         args.max_num_batched_tokens or 128,
                         Path(tempfile.mkdtemp(prefix="infllm-wire-")) if args.wire_trace and n == 2 else None,
                         (Path(tempfile.mkdtemp(prefix="infllm-py-spy-")), args.py_spy) if args.py_spy and n == 2 else None,
                         args.instance_cpus)
              for n in counts]
    if args.profile_dir:
        import pstats

        for path in sorted(args.profile_dir.glob("infinited-*.prof")):
            print(f"--- {path.name}, by own time")
            pstats.Stats(str(path)).sort_stats("tottime").print_stats(22)
    for row in splits:
        row["vs_one_instance"] = row["decode_tokens_per_s"] / splits[0]["decode_tokens_per_s"]
    chunk_blocks = math.ceil((args.max_num_batched_tokens or 128) / BLOCK_SIZE)
    if args.no_moves:
        moves = []
    elif args.move_window:
        moves = [toggled_move_case(context_blocks, prompt, args.new_tokens, k, args.device, extra_args,
                                   args.spread_gpus, chunk_blocks, args.instance_cpus, args.move_repeats,
                                   args.move_window, args.move_window_skip,
                                   Path(tempfile.mkdtemp(prefix="infllm-wire-")) if args.wire_trace else None,
                                   args.move_every)
                 for k in move_blocks]
    else:
        moves = [move_case(context_blocks, prompt, args.new_tokens, k, args.device, extra_args, args.spread_gpus,
                           chunk_blocks, args.instance_cpus, args.move_repeats)
                 for k in move_blocks]

    gpu = torch.cuda.get_device_name().replace(" ", "-") if args.device.startswith("cuda") else "cpu"
    report = {"device": gpu, "machine": platform.node(), "instance_cpus": args.instance_cpus, "torch": torch.__version__, "model": args.model or "SmolLM2-135M-Instruct",
              "cuda_mps": args.mps, "remote_attention": args.remote_attention or "auto", "steps_ahead": args.steps_ahead if args.steps_ahead is not None else 1, "nccl_links": args.nccl_links or "auto", "spread_gpus": args.spread_gpus, "peer_spin_s": args.peer_spin_s, "peer_header_ring_bytes": args.peer_header_ring_bytes, "context_blocks": context_blocks, "new_tokens": args.new_tokens, "splits": splits, "moves": moves}
    if args.split_decode_interval is not None:
        report["split_decode_interval"] = args.split_decode_interval
    suffix = (f"-{Path(args.model).name}" if args.model else "") + ("-mps" if args.mps else "")
    suffix += (f"-x{torch.cuda.device_count()}-{context_blocks * BLOCK_SIZE // 1024}k" if args.spread_gpus else "") + (f"-spin{args.peer_spin_s:g}" if args.peer_spin_s is not None else "") + (f"-ring{args.peer_header_ring_bytes}" if args.peer_header_ring_bytes is not None else "")
    suffix += "-eager-creditor" if args.creditor_cuda_graphs is False else ""
    suffix += f"-{args.remote_attention}" if args.remote_attention else ""
    suffix += f"-ahead{args.steps_ahead}" if args.steps_ahead is not None else ""
    suffix += f"-links-{args.nccl_links}" if args.nccl_links is not None else ""
    suffix += f"-interval{args.split_decode_interval}" if args.split_decode_interval is not None else ""
    suffix += "-pinned" if args.instance_cpus else ""
    suffix += "-moves" if args.moves_only else ""
    suffix += "-toggled" if args.move_window and not args.no_moves else ""
    suffix += f"-paced{args.move_every}" if args.move_every and not args.no_moves else ""
    out = Path(args.out_dir) / f"daemon-{gpu}{suffix}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'instances':>9} {'placement':>12} {'decode tok/s':>13} {'vs one':>7}")
    for r in splits:
        print(f"{r['instances']:>9} {str(r['placement']):>12} {r['decode_tokens_per_s']:>13.2f} {r['vs_one_instance']:>7.3f}")
    for r in splits:
        for name, text in r.get("threads", {}).items():
            print(f"--- {name} at the first decode step\n{text}")
        for name, summary in r.get("py_spy", {}).items():
            for kind, frames in summary.items():
                print(f"--- {name}: {kind} time during decode")
                for share, frame in frames:
                    print(f"  {100 * share:5.1f}% {frame[:160]}")
        if r.get("attend_breakdown"):
            print(f"  {r['instances']} instances: {r['attend_breakdown']['attend_requests']} decode attend requests, "
                  f"frames with separate buffers {r['attend_breakdown']['frames_with_separate_buffers']}")
        for interval, us in r.get("attend_breakdown", {}).get("median_us", {}).items():
            print(f"  {r['instances']} instances, median of a decode attend request: {interval:>32} {us:8.1f} us")
    for r in splits[1:]:
        home = r["latencies"].get(1, {})
        served = [v["attend_serve_mean_s"] for k, v in r["latencies"].items() if k != 1 and "attend_serve_mean_s" in v]
        if home.get("remote_attention_mean_s") and served:
            print(f"  {r['instances']} instances: remote attention wait {1e6 * home['remote_attention_mean_s']:.0f} us "
                  f"per layer, of which serving {1e6 * sum(served) / len(served):.0f} us")
    if moves and moves[0].get("design") == "toggled windows":
        print(f"KV split; windows without moves and with moves ({moves[0]['pacing']}) alternate within each "
              "request (all at home: tok/s local)")
    elif moves:
        print("KV split; tok/s without moves (at the moving runs' mean split) and with moves back to back "
              "(all at home: tok/s local)")
    print(f"{'moved':>6} {'tok/s local':>12} {'tok/s without':>14} {'tok/s with':>11} {'cost':>7} {'moves/step':>10}")
    for r in moves:
        if r.get("design") == "toggled windows":
            print(f"{r['tokens_per_move']:>6} {r['decode_tokens_per_s_local']:>12.2f} {'':>14} {'':>11} "
                  f"{100 * r['throughput_cost']:>6.1f}% {r['moves_per_step_in_compared_windows']:>10.2f}"
                  f"   (standard error {100 * r['standard_error']:.1f}% over requests, "
                  f"{100 * r['standard_error_over_windows']:.1f}% over windows; {r['windows_compared']} windows "
                  f"with moves, each against its neighbours without; {r['windows_left_out']} windows left out)")
            print(f"       per request {[None if c is None else round(100 * c, 1) for c in r['per_run_cost']]} %; "
                  f"{r['tokens_moved_per_measured_step']:.1f} tokens moved a measured step, a move took "
                  f"{1e3 * (r['move_seconds_mean'] or float('nan')):.1f} ms on average")
            breakdown = r.get("attend_breakdown", {})
            if breakdown.get("with_moves") and breakdown.get("without_moves"):
                with_, without = breakdown["with_moves"], breakdown["without_moves"]
                print(f"       a decode attend request, mean us without / with moves "
                      f"({without['attend_requests']} / {with_['attend_requests']} requests):")
                for interval, us in without["mean_us"].items():
                    print(f"       {interval:>32} {us:8.1f} {with_['mean_us'][interval]:8.1f}")
                print(f"       {'landed -> next request':>32} {without['landed_to_next_request_mean_us'] or 0:8.1f} "
                      f"{with_['landed_to_next_request_mean_us'] or 0:8.1f}")
            continue
        print(f"{r['tokens_per_move']:>6} {r['decode_tokens_per_s_local']:>12.2f} {r['decode_tokens_per_s_without']:>14.2f} "
              f"{r['decode_tokens_per_s_with']:>11.2f} {100 * r['throughput_cost']:>6.1f}% {r['moves_per_step']:>10.2f}")
        print(f"       runs without {[round(x, 2) for x in r['runs_tokens_per_s_without']]}, "
              f"with {[round(x, 2) for x in r['runs_tokens_per_s_with']]}")
        print(f"       creditor without moves {r['creditor_without']}\n       creditor with moves {r['creditor_with']}")


if __name__ == "__main__":
    main()
