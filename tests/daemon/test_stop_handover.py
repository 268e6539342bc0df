"""End to end: SIGTERM to an instance that holds KV blocks of another instance's request.

Instance 1 decodes a request whose KV spills onto instance 2. SIGTERM to instance 2 asks the
gManager leader to drain it: instance 1 moves those segments to instance 3 between its steps, the
request finishes with the tokens of an undisturbed run, instance 2 exits 0 well within its
drain_s and the gManager forgets it. Then, with no gManager running, SIGTERM to instance 3 while
it holds blocks of another request of instance 1: it waits its (short) drain_s, warns that the
blocks are lost to their home, and exits 0; the home, with no room left anywhere to recompute
them, ends that request with an error.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from infinite_llm.daemon.local_cluster import Generation, Instance, LocalCluster, passkey_prompt, wait_for
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scheduler"))
from gmanager_testlib import GManagerProcess  # noqa: E402

# Instance 1's prompts (390 and 392 tokens, about 25 blocks of 16) overflow its 16 blocks. It
# spills to the peer with the most free blocks: instance 2 while it runs, then instance 3,
# which has room for everything instance 2 holds.
POOLS = {1: 16, 2: 48, 3: 28}
HANDOVER_PROMPT = passkey_prompt(26, key_item=42)
HANDOVER_TOKENS = 128
# 390 tokens: the last prefill chunk (128 tokens) is 6 tokens, so about 8 of the home's blocks
# stay free after the prefill and its decode needs no more room while instance 3 stops.
STRANDED_PROMPT = passkey_prompt(26, key_item=5)
# Decodes well past instance 3's drain_s, and fits in the cluster (instances 1 and 3: 44 blocks).
STRANDED_TOKENS = 250
DRAIN_S = 60.0  # instances 1 and 2
SHORT_DRAIN_S = 4.0  # instance 3
WAIT_S = 120.0


def decoding_with_kv_on(instance: Instance, run: Generation, creditor: int) -> bool:
    """``run`` has produced a token past its prompt and has KV blocks on ``creditor``."""
    if run.error is not None:
        raise run.error
    return len(run.tokens) >= 2 and any(creditor in {s["instance_id"] for s in r["segments"]}
                                        for r in instance.status()["requests"])


def start_instance(cluster: LocalCluster, inst_id: int, pool_blocks: int, extra_args: list[str]) -> None:
    """One more instance of ``cluster`` with flags of its own (LocalCluster gives all the same)."""
    env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               UCX_TLS="tcp,sm,self")
    env.pop("TRITON_INTERPRET", None)
    socket_path = cluster.socket_dir / f"infinited-{inst_id}.sock"
    log_path = cluster.root / f"infinited-{inst_id}.log"
    args = [sys.executable, "-m", "infinite_llm.daemon", "--instance-id", str(inst_id),
            "--kv-pool-blocks", str(pool_blocks), "--block-size", "16", "--max-num-batched-tokens", "128",
            "--device", "cpu", "--http-port", "0", "--socket-path", str(socket_path),
            "--state-dir", str(cluster.state_dir), "--peer-host", "127.0.0.1", *extra_args]
    with open(log_path, "w") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    cluster.instances[inst_id] = Instance(inst_id, process, socket_path, log_path)


def stop_and_time(instance: Instance, timeout_s: float) -> float:
    """SIGTERM; seconds until the process exited (asserting it did within ``timeout_s``)."""
    started = time.monotonic()
    instance.process.send_signal(signal.SIGTERM)
    try:
        instance.process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"instance {instance.inst_id} still runs {timeout_s} s after SIGTERM: "
                    f"{instance.log_path.read_text()[-3000:]}")
    return time.monotonic() - started


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("stop")
    cluster = LocalCluster(root, num_instances=2, pool_blocks=0, pool_blocks_per_instance=[POOLS[1], POOLS[2]],
                           extra_args=["--drain-s", str(DRAIN_S)])
    start_instance(cluster, 3, POOLS[3], ["--drain-s", str(SHORT_DRAIN_S)])
    gmanager = GManagerProcess(cluster.state_dir, "gm", [
        "--heartbeat-interval-s", "1", "--block-size", "16", "--move-timeout-s", "30",
        "--plan-interval-s", "3600"])  # no policy round: only the drain moves blocks
    try:
        cluster.wait_ready()
        gmanager.wait_leading()
        yield cluster, gmanager
    finally:
        cluster.stop()
        gmanager.stop()


def undisturbed_tokens() -> list[int]:
    """The undisturbed run: one engine with room for everything, in this process."""
    torch.set_num_threads(1)
    engine = LLMEngine(load_checkpoint(None, show_progress=False),
                       EngineConfig(block_size=16, pool_blocks=(64,), max_num_batched_tokens=128))
    (expected,) = engine.generate([HANDOVER_PROMPT], SamplingParams(max_tokens=HANDOVER_TOKENS, ignore_eos=True))
    return list(expected.token_ids)


def test_sigterm_hands_held_segments_over_and_the_request_finishes_unchanged(cluster):
    # The undisturbed run goes on in a worker thread (one torch thread) while the cluster
    # decodes and hands over, which keeps the two cores only partly busy.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        expected = pool.submit(undisturbed_tokens)
        tokens = hand_over_while_decoding(*cluster)
        assert tokens == expected.result()


def hand_over_while_decoding(cluster: LocalCluster, gmanager: GManagerProcess) -> list[int]:
    """SIGTERM to instance 2 while it holds blocks of instance 1's decoding request; the
    request's tokens."""
    run = Generation(cluster[1], HANDOVER_PROMPT, HANDOVER_TOKENS)
    wait_for("instance 1's request decodes with KV on instance 2",
             lambda: decoding_with_kv_on(cluster[1], run, creditor=2))
    held = cluster[2].status()["pool"]["num_blocks_held_for_others"]
    assert held > 0
    wait_for("the gManager sees instance 2 holding blocks", lambda: any(
        i["instance_id"] == 2 and i["num_blocks_lent"] > 0 for i in gmanager.status()["instances"]), timeout_s=30)

    elapsed = stop_and_time(cluster[2], timeout_s=DRAIN_S)
    assert cluster[2].process.returncode == 0
    assert run.thread.is_alive(), "instance 1's request should still decode once instance 2 is gone"
    log = cluster[2].log_path.read_text()
    # The count may have grown by a spill between the status above and the signal.
    assert re.search(r"hand-over: holding \d+ blocks in \d+ segments? for instance 1\n", log), log[-3000:]
    assert "hand-over: the gManager leader (epoch" in log and "drains instance 2" in log, log[-3000:]
    assert "hand-over done after" in log and "stop deadline" not in log, log[-3000:]
    assert elapsed < DRAIN_S
    assert gmanager.status()["moves"].get("committed", 0) >= 1

    tokens = run.join()
    assert run.finish_reason == "length"
    wait_for("instance 3 frees the moved segments once the request finished",
             lambda: cluster[3].status()["pool"]["num_blocks_held_for_others"] == 0, timeout_s=10)
    wait_for("the gManager forgets instance 2",
             lambda: all(i["instance_id"] != 2 for i in gmanager.status()["instances"]), timeout_s=30)
    return tokens


def test_sigterm_without_a_leader_exits_at_the_deadline_and_says_what_is_lost(cluster):
    cluster, gmanager = cluster
    if cluster[2].process.poll() is None:  # run alone: instance 2 would take the spill
        stop_and_time(cluster[2], timeout_s=DRAIN_S)
    assert gmanager.stop() == 0
    run = Generation(cluster[1], STRANDED_PROMPT, STRANDED_TOKENS)
    wait_for("instance 1's request decodes with KV on instance 3",
             lambda: decoding_with_kv_on(cluster[1], run, creditor=3))
    held = cluster[3].status()["pool"]["num_blocks_held_for_others"]
    assert held > 0

    elapsed = stop_and_time(cluster[3], timeout_s=SHORT_DRAIN_S + 30)
    assert cluster[3].process.returncode == 0
    assert elapsed >= SHORT_DRAIN_S - 0.5
    log = cluster[3].log_path.read_text()
    assert "no gManager leader is known" in log, log[-3000:]
    assert re.search(rf"WARNING infinite_llm.daemon.instance: stop deadline \(drain_s {SHORT_DRAIN_S:.0f} s\) "
                     r"passed holding \d+ blocks in \d+ segments? for instance 1: lost to their homes", log), log[-3000:]
    # The home cannot recompute the lost blocks: instance 2 left, instance 3 is gone and its
    # own pool is too small. The request fails with that said; the home itself serves on.
    run.thread.join(timeout=WAIT_S)
    assert not run.thread.is_alive() and run.finish_reason == "error", (run.finish_reason, run.error)
    wait_for("instance 1 runs nothing", lambda: cluster[1].status()["requests"] == [], timeout_s=10)
