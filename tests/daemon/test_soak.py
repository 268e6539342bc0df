"""Soak: three CPU instances and a gManager under a steady client load, with a drain in the middle.

Eight client threads loop for the run's duration, each picking a home instance and a request:
mostly short prompts, some long enough to spill their KV onto the other instances, a few bad
ones (``max_tokens=0``, a prompt over the model's context, one over the cluster's KV) that must
be refused with an explicit error. A third of the way in, instance 3 is drained through the
gManager (as ``infctl drain`` does) and uncordoned once safe to stop; the load goes on.

At the end: every request sent either completed or got an explicit error (nothing hung, every
wait is bounded), the daemons' resident memory and open descriptors stayed flat after a
warm-up, the KV pools are all free again, the gManager moved blocks and the drain finished.

The figures are printed on one line (``SOAK ...``) and, when ``INFLLM_SOAK_REPORT`` names a
file, written there as JSON.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import pytest

from infinite_llm.cli.client import ClusterClient, Refused
from infinite_llm.daemon.local_cluster import Instance, LocalCluster, UnixHTTPConnection, passkey_prompt, wait_for

PERF_MODEL = Path(__file__).resolve().parents[2] / "bench" / "results" / "perf_model-cpu.json"
POOL_BLOCKS = 32  # 512 tokens an instance: a long prompt (33 to 41 blocks) spills onto the others
CONCURRENCY = 8
DRAINED = 3
WARM_UP_FRACTION = 0.2  # the memory and descriptor baselines are taken this far into the run
DRAIN_AT_FRACTION = 0.3
RSS_GROWTH_LIMIT = 0.05  # of private resident memory (anonymous and file pages)
# Besides the regions: the header rings (2 MiB of data each, one per connection between local
# peers, both ways) and the shared pages of the loaded libraries.
SHM_RING_SLACK_KB = 32 << 10
# Descriptors may differ by a few without a leak: the baseline is taken under load, the end
# sample idle, and what is open at either moment depends on what is in flight then (an accepted
# admin connection whose close the event loop has not reached yet, a UCX endpoint's transient
# socket or eventfd, a shared-memory region or header ring mapped for a frame). A connection
# opened on first need costs more (8 or 9: a UCX endpoint's sockets and its shared memory and
# ring files): the gManager opens one to each instance at its first command there, so every
# such connection is opened before the baseline (``prime_connections``).
FD_SLACK = 4
# On two shared cores a request may queue behind long prefills for most of a minute: a hang is
# a request with no progress for REQUEST_OP_TIMEOUT_S (its first line comes after its prefill).
REQUEST_OP_TIMEOUT_S = 120.0  # each socket operation of one request
REQUEST_TIMEOUT_S = 180.0  # one request from connect to its last line
IDLE_TIMEOUT_S = 30.0
# glibc keeps memory the daemons freed: its mmap threshold climbs to 32 MiB after the first large
# free, and from then on tensors come from the heaps, whose free pages stay resident (300 MiB of
# them after a minute here, by mallinfo2, with the bytes in use flat). Fixed thresholds (and
# fewer arenas) make the resident figure follow the memory in use, which is what may not grow.
ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072", "MALLOC_ARENA_MAX": "2"}
DRAIN_TIMEOUT_S = 90.0

COMPLETED = "completed"
# Explicit errors: an HTTP error with its message, or a stream whose last line says it failed.
REFUSED_DRAINING = "refused_draining"  # 503 from the instance being drained: expected
REJECTED_BAD = "rejected_bad"  # a deliberately bad request refused with 400: expected
REFUSED_OTHER = "refused_other"  # a good request refused for another reason
FAILED_MIDWAY = "failed_midway"  # admitted, then a last line with finish_reason error/abort
EXPLICIT_ERRORS = (REFUSED_DRAINING, REJECTED_BAD, REFUSED_OTHER, FAILED_MIDWAY)
# Neither completed nor an explicit error: each one is a failure of the test.
TIMED_OUT = "timed_out"  # no answer within the request's bounded waits: a hang
BROKEN = "broken"  # the connection broke, or the stream ended without a finished line
WRONG_LENGTH = "wrong_length"  # finished, but not with the tokens asked for (ignore_eos)
BAD_ACCEPTED = "bad_accepted"  # a bad request that was not refused with 400


def daemon_pids(cluster: LocalCluster) -> dict[str, int]:
    pids = {f"infinited-{inst.inst_id}": inst.process.pid for inst in cluster}
    if cluster.gmanager is not None:
        pids["gmanager"] = cluster.gmanager.pid
    return pids


def fd_kinds(pid: int) -> dict[str, int]:
    """Open descriptors by what they are (socket, pipe, anon_inode:[eventfd], a file's folder)."""
    kinds: Counter = Counter()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        kinds[target.split(":[")[0] if ":[" in target else str(Path(target).parent)] += 1
    return dict(kinds)


def sample(cluster: LocalCluster, pids: dict[str, int]) -> dict[str, dict[str, Any]]:
    """Resident memory (kB, and what it is) and open descriptors of each daemon, and the use of
    each instance's peer shared memory (its pages stay resident once touched)."""
    figures = {}
    for name, pid in pids.items():
        rss_kb, parts = None, {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss_kb = int(line.split()[1])
            elif line.startswith(("RssAnon:", "RssFile:", "RssShmem:")):  # what the resident memory is
                parts[line.split(":")[0].lower() + "_kb"] = int(line.split()[1])
        assert rss_kb is not None, f"no VmRSS for {name} (pid {pid})"
        figures[name] = {"rss_kb": rss_kb, **parts, "fds": len(os.listdir(f"/proc/{pid}/fd")),
                         "fd_kinds": fd_kinds(pid)}
    for inst in cluster:
        shared = inst.status()["peer_shared_memory"]
        figures[f"infinited-{inst.inst_id}"].update(shm_committed_kb=shared["committed_bytes"] >> 10,
                                                   shm_in_use_kb=shared["in_use_bytes"] >> 10)
    return figures


def private_kb(figures: dict[str, Any]) -> int:
    """Resident memory that is the daemon's own (anonymous and file pages), in kB."""
    return figures["rssanon_kb"] + figures["rssfile_kb"]


def prime_connections(cluster: LocalCluster) -> None:
    """Have the gManager open its connection to every instance now, before the baselines: an
    uncordon of an instance that is not cordoned is a command it sends and the instance takes
    (nothing changes). The instances connect to one another, and to the gManager for their
    heartbeats, as they start."""
    client = ClusterClient(cluster.state_dir)
    for inst in cluster:
        client.uncordon(inst.inst_id)
        assert inst.status()["draining"] is False


class Load:
    """The client threads and the tally of their outcomes."""

    def __init__(self, cluster: LocalCluster, stop_at: float, seed: int) -> None:
        self.cluster = cluster
        self.stop_at = stop_at
        self.lock = threading.Lock()
        self.outcomes: Counter = Counter()
        self.by_kind: Counter = Counter()  # (kind, outcome)
        self.completed_on: Counter = Counter()  # home instance -> completed requests
        self.completed_after_uncordon: Counter = Counter()
        self.uncordoned_at: float | None = None
        self.problems: list[str] = []  # the first unexpected outcomes, with what was asked
        self.longest_s = 0.0
        self.num_tokens = 0
        self.threads = [threading.Thread(target=self._client, args=(random.Random(seed * 100 + i),),
                                         name=f"soak-client-{i}", daemon=True) for i in range(CONCURRENCY)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def join(self, timeout_s: float, every_5_s: Callable[[], None]) -> list[str]:
        """Wait for every client, calling ``every_5_s`` meanwhile; the names of those still
        running after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            while thread.is_alive() and time.monotonic() < deadline:
                thread.join(timeout=min(5.0, max(0.1, deadline - time.monotonic())))
                if thread.is_alive():
                    every_5_s()
        return [t.name for t in self.threads if t.is_alive()]

    def _client(self, rng: random.Random) -> None:
        while time.monotonic() < self.stop_at:
            home = self.cluster[rng.randint(1, len(self.cluster.instances))]
            kind, prompt, params = self._pick(rng)
            started = time.monotonic()
            outcome, detail, num_tokens = self._send(home, kind, prompt, params)
            elapsed = time.monotonic() - started
            if outcome == COMPLETED and elapsed > REQUEST_TIMEOUT_S:
                outcome, detail = TIMED_OUT, f"completed only after {elapsed:.0f} s"
            with self.lock:
                self.outcomes[outcome] += 1
                self.by_kind[kind, outcome] += 1
                self.longest_s = max(self.longest_s, elapsed)
                self.num_tokens += num_tokens
                if outcome == COMPLETED:
                    self.completed_on[home.inst_id] += 1
                    if self.uncordoned_at is not None and started > self.uncordoned_at:
                        self.completed_after_uncordon[home.inst_id] += 1
                if outcome not in (COMPLETED, REFUSED_DRAINING, REJECTED_BAD) and len(self.problems) < 20:
                    self.problems.append(f"{outcome} on instance {home.inst_id} ({kind}, "
                                         f"{params}): {detail}")

    @staticmethod
    def _pick(rng: random.Random) -> tuple[str, Any, dict[str, Any]]:
        draw = rng.random()
        if draw < 0.02:
            return "bad_max_tokens", passkey_prompt(rng.randint(2, 10)), {"max_tokens": 0}
        if draw < 0.04:  # token ids: no tokenizing of megabytes of text
            return "bad_over_context", [rng.randint(100, 5000) for _ in range(9000)], {"max_tokens": 4}
        if draw < 0.06:  # 3200 tokens: more KV than the three pools hold
            return "bad_over_kv", passkey_prompt(200), {"max_tokens": 4}
        if draw < 0.26:  # 530 to 650 tokens and the output: more than one pool
            return "long", passkey_prompt(rng.randint(34, 42), rng.randint(0, 33)), {
                "max_tokens": rng.randint(2, 20), "ignore_eos": True, "temperature": 0}
        return "short", passkey_prompt(rng.randint(1, 12), rng.randint(0, 1)), {
            "max_tokens": rng.randint(1, 32), "ignore_eos": True, "temperature": rng.choice((0, 0.7))}

    @staticmethod
    def _send(home: Instance, kind: str, prompt: Any, params: dict[str, Any]) -> tuple[str, str, int]:
        """One request through the instance's ``/v1/generate`` stream: (outcome, detail, tokens)."""
        bad = kind.startswith("bad")
        deadline = time.monotonic() + REQUEST_TIMEOUT_S
        conn = UnixHTTPConnection(str(home.socket_path), timeout=REQUEST_OP_TIMEOUT_S)
        try:
            conn.request("POST", "/v1/generate", body=json.dumps({"prompt": prompt, "params": params}).encode(),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                error = json.loads(response.read()).get("error", "")
                if not error:
                    return BROKEN, f"HTTP {response.status} with no error message", 0
                if response.status == 503 and "draining" in error:  # checked before the prompt
                    return REFUSED_DRAINING, error, 0
                if bad:
                    return (REJECTED_BAD if response.status == 400 else BAD_ACCEPTED), error, 0
                return REFUSED_OTHER, f"HTTP {response.status}: {error}", 0
            if bad:
                response.read()
                return BAD_ACCEPTED, "HTTP 200", 0
            num_tokens, finish_reason = 0, None
            for line in response:
                if not line.strip():
                    continue
                event = json.loads(line)
                num_tokens += len(event["token_ids"])
                if event["finished"]:
                    finish_reason = event["finish_reason"]
                if time.monotonic() > deadline:
                    return TIMED_OUT, f"still streaming after {REQUEST_TIMEOUT_S:g} s", num_tokens
            if finish_reason in ("error", "abort"):
                return FAILED_MIDWAY, f"finish_reason {finish_reason} after {num_tokens} tokens", num_tokens
            if finish_reason is None:
                return BROKEN, f"the stream ended without a finished line after {num_tokens} tokens", num_tokens
            if num_tokens != params["max_tokens"]:
                return WRONG_LENGTH, f"{num_tokens} tokens, finish_reason {finish_reason}", num_tokens
            return COMPLETED, finish_reason, num_tokens
        except (socket.timeout, TimeoutError) as exc:
            return TIMED_OUT, f"no answer within {REQUEST_OP_TIMEOUT_S:g} s: {exc!r}", 0
        except Exception as exc:  # noqa: BLE001 (tallied, and fails the test)
            return BROKEN, repr(exc), 0
        finally:
            conn.close()


def drain_and_uncordon(cluster: LocalCluster, load: Load) -> dict[str, Any]:
    """Drain instance DRAINED through the gManager leader, as ``infctl drain`` does, retrying while
    the others lack room for what it holds (409, nothing moved); then uncordon it."""
    client = ClusterClient(cluster.state_dir)
    started = time.monotonic()
    deadline = started + DRAIN_TIMEOUT_S
    refusals = 0
    while True:
        try:
            report = client.drain(DRAINED, timeout_s=max(1.0, deadline - time.monotonic()))
            break
        except Refused as exc:
            if exc.status != 409 or time.monotonic() > deadline:
                raise
            refusals += 1
            time.sleep(0.5)
    # An instance whose heartbeats stopped for a few seconds (a long step on two busy cores) is
    # left out by the gManager, and a drain of it that held nothing for others then ends as
    # "stopped", which `infctl drain` takes for done although the instance still runs requests.
    # It heartbeats again and the gManager resumes the drain: wait for the drain's real end.
    early_ends = []
    while not report["safe_to_stop"]:
        if report.get("state") in ("stopped", "lost") and (not early_ends or early_ends[-1] != report):
            early_ends.append(report)
        assert time.monotonic() < deadline, f"the drain did not end within {DRAIN_TIMEOUT_S:g} s: {report}"
        time.sleep(0.5)
        report = gmanager_get(cluster, f"/v1/drain/{DRAINED}")
    drained_s = time.monotonic() - started
    status = cluster[DRAINED].status()
    assert status["draining"] is True, status
    client.uncordon(DRAINED)
    wait_for("the uncordoned instance admits again", lambda: cluster[DRAINED].status()["draining"] is False,
             timeout_s=10)
    with load.lock:
        load.uncordoned_at = time.monotonic()
    return {"drain_s": round(drained_s, 1), "refusals": refusals, "rounds": report.get("rounds"),
            "move_results": report.get("move_results"),
            "early_ends": [{k: r.get(k) for k in ("state", "running_requests", "elapsed_s")} for r in early_ends]}


def gmanager_get(cluster: LocalCluster, path: str) -> dict[str, Any]:
    conn = UnixHTTPConnection(str(cluster.gmanager_socket), timeout=30)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        body = json.loads(response.read())
    finally:
        conn.close()
    assert response.status == 200, body
    return body


def idle(inst: Instance) -> dict[str, Any] | None:
    status = inst.status()
    pool = status["pool"]
    quiet = (not status["requests"] and not status["held_segments"] and not status["holds"]
             and pool["num_blocks_free"] == pool["num_blocks_total"] == POOL_BLOCKS
             and pool["num_blocks_held_for_others"] == pool["num_blocks_reserved_for_others"]
             == pool["num_blocks_kept_for_others"] == 0)
    return status if quiet else None


DURATIONS = [pytest.param(60, id="60s", marks=pytest.mark.slow), pytest.param(600, id="10min", marks=pytest.mark.slow)]


@pytest.mark.parametrize("duration_s", DURATIONS)
def test_soak_load_with_a_drain_leaks_nothing_and_hangs_nothing(tmp_path, duration_s):
    began = time.monotonic()
    cluster = LocalCluster(tmp_path, num_instances=3, pool_blocks=POOL_BLOCKS, extra_env=ALLOCATOR_ENV,
                           gmanager_perf_model=PERF_MODEL,
                           gmanager_args=["--heartbeat-interval-s", "1", "--block-size", "16",
                                          "--plan-interval-s", "1", "--move-timeout-s", "30",
                                          "--election-poll-s", "0.1"])
    load = None
    try:
        cluster.wait_ready()
        wait_for("the gManager leads", lambda: cluster.gmanager_status()["leader"], timeout_s=30, interval_s=0.2)
        prime_connections(cluster)
        started_s = time.monotonic() - began
        pids = daemon_pids(cluster)
        t0 = time.monotonic()
        load = Load(cluster, stop_at=t0 + duration_s, seed=duration_s)
        load.start()
        samples = []  # (seconds into the run, figures): the trend, for the report

        def sample_until(until: float) -> None:
            while time.monotonic() < until:
                time.sleep(min(5.0, max(0.0, until - time.monotonic())))
                samples.append((round(time.monotonic() - t0, 1), sample(cluster, pids)))

        sample_until(t0 + WARM_UP_FRACTION * duration_s)
        warm = sample(cluster, pids)
        sample_until(t0 + DRAIN_AT_FRACTION * duration_s)
        drain = drain_and_uncordon(cluster, load)
        sample_until(t0 + duration_s)
        stuck = load.join(REQUEST_TIMEOUT_S + 10, lambda: samples.append((round(time.monotonic() - t0, 1),
                                                                            sample(cluster, pids))))
        load_s = time.monotonic() - t0
        assert not stuck, f"client threads still waiting on a request: {stuck}"

        for inst in cluster:
            wait_for(f"instance {inst.inst_id} idle with every block free",
                     lambda inst=inst: idle(inst), timeout_s=IDLE_TIMEOUT_S, interval_s=0.25)
        end = sample(cluster, pids)
        gm = cluster.gmanager_status()
        remote = sum(inst.metrics().get("infllm_remote_attention_seconds_count", 0) for inst in cluster)
    except BaseException:
        for path in sorted(tmp_path.glob("*.log")):
            print(f"--- {path.name}\n{path.read_text()[-3000:]}")
        raise
    finally:
        if load is not None:
            load.stop_at = 0  # clients still looping (a failure above) send nothing more
        cluster.stop()
    total_s = time.monotonic() - began
    # Moves the daemons gave up on (each is abandoned and its request goes on), by their reason.
    failed_moves: Counter = Counter()
    for path in tmp_path.glob("infinited-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if "WARNING infinite_llm.daemon.peers: move of" in line and " failed: " in line:
                failed_moves[line.split(" failed: ", 1)[1][:80]] += 1

    outcomes = load.outcomes
    sent = sum(outcomes.values())
    explicit = sum(outcomes[o] for o in EXPLICIT_ERRORS)
    report = {
        "duration_s": duration_s, "total_s": round(total_s, 1), "start_s": round(started_s, 1),
        "load_s": round(load_s, 1), "requests": sent, "completed": outcomes[COMPLETED], "errors": explicit,
        "outcomes": dict(outcomes), "by_kind": {f"{k}/{o}": n for (k, o), n in sorted(load.by_kind.items())},
        "tokens": load.num_tokens, "longest_request_s": round(load.longest_s, 1),
        "completed_on": dict(load.completed_on), "completed_after_uncordon": dict(load.completed_after_uncordon),
        "drain": drain, "gmanager_moves": gm["moves"], "remote_attention_calls": remote,
        "failed_moves_in_logs": dict(failed_moves),
        "warm_up": warm, "end": end, "samples": samples, "problems": load.problems,
    }
    rss = " ".join(f"{name} {warm[name]['rss_kb'] // 1024}->{end[name]['rss_kb'] // 1024}MiB"
                   f" (private {private_kb(warm[name]) // 1024}->{private_kb(end[name]) // 1024})"
                   for name in pids)
    fds = " ".join(f"{name} {warm[name]['fds']}->{end[name]['fds']}" for name in pids)
    shm = " ".join(f"{name} {warm[name]['rssshmem_kb'] // 1024}->{end[name]['rssshmem_kb'] // 1024}MiB"
                   for name in pids if name.startswith("infinited"))
    print(f"\nSOAK {duration_s}s: total {total_s:.0f}s, requests {sent}, completed {outcomes[COMPLETED]}, "
          f"errors {explicit} ({', '.join(f'{o} {outcomes[o]}' for o in EXPLICIT_ERRORS)}), "
          f"longest {load.longest_s:.1f}s, moves {gm['moves']}, drain {drain['drain_s']}s, "
          f"rss {rss} (of which shared memory {shm}), fds {fds}, failed moves in logs {sum(failed_moves.values())}")
    if path := os.environ.get("INFLLM_SOAK_REPORT"):
        Path(path).write_text(json.dumps(report, indent=2) + "\n")

    # Every request completed or got an explicit error: none hung, broke or came out wrong.
    assert sent == outcomes[COMPLETED] + explicit, (dict(outcomes), load.problems)
    # Nothing fails in this run (no instance is lost), so a good request ends in error only
    # through a fault of the daemons; the only refusals are the draining instance's.
    assert outcomes[REFUSED_OTHER] == outcomes[FAILED_MIDWAY] == 0, (dict(outcomes), load.problems)
    assert outcomes[COMPLETED] >= 10, report
    for kind in ("long", "short"):
        assert load.by_kind[kind, COMPLETED] >= 1, report
    assert remote > 0, "no request's KV spilled onto another instance"
    assert load.completed_after_uncordon[DRAINED] >= 1, "the uncordoned instance served nothing afterwards"
    # The gManager moved blocks (its policy rounds, the drain's moves) and the drain ended.
    assert gm["moves"].get("committed", 0) >= 1, gm["moves"]
    # Flat private memory and descriptors from the warm-up on. Shared memory is held apart: its
    # resident pages are those of the transports' regions touched so far (this daemon's own and
    # the peers' it maps), which fill up to the largest frames in flight (a move's KV) and are
    # then reused, so it is bounded by the regions' committed bytes rather than flat.
    shm_committed_kb = sum(end[f"infinited-{inst.inst_id}"]["shm_committed_kb"] for inst in cluster)
    for name in pids:
        assert private_kb(end[name]) < private_kb(warm[name]) * (1 + RSS_GROWTH_LIMIT), (name, warm[name], end[name])
        assert end[name]["rssshmem_kb"] <= shm_committed_kb + SHM_RING_SLACK_KB, (name, shm_committed_kb, end[name])
        assert end[name]["fds"] <= warm[name]["fds"] + FD_SLACK, (name, warm[name], end[name])
