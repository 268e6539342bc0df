"""Real failures: a home killed with SIGKILL, and the daemon's life as systemd sees it."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import socket
import threading
import time

import pytest
import torch

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

POOL_BLOCKS = 40


def test_creditor_frees_a_killed_homes_segments_and_keeps_serving(tmp_path):
    cluster = LocalCluster(tmp_path, num_instances=2, pool_blocks=POOL_BLOCKS,
                           extra_args=["--heartbeat-interval-s", "0.5", "--debtor-lost-s", "3"])
    try:
        cluster.wait_ready()
        home, creditor = cluster[1], cluster[2]
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["tokens"] = home.generate(passkey_prompt(50), max_tokens=400, ignore_eos=True)
            except Exception as exc:  # the home dies mid-request: its client sees the connection go
                outcome["error"] = exc

        thread = threading.Thread(target=run)
        thread.start()
        deadline = time.monotonic() + 120
        while not creditor.status()["held_segments"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert creditor.status()["held_segments"], "the home should have spilled to the creditor"
        os.killpg(home.process.pid, signal.SIGKILL)
        home.process.wait(timeout=10)
        thread.join(timeout=30)
        assert "error" in outcome

        killed_at = time.monotonic()
        while creditor.status()["held_segments"] and time.monotonic() - killed_at < 20:
            time.sleep(0.2)
        status = creditor.status()
        assert status["held_segments"] == [] and status["pool"]["num_blocks_free"] == POOL_BLOCKS
        assert time.monotonic() - killed_at >= 2.5  # freed after the timeout, not before
        tokens, _ = creditor.generate("The sky is", max_tokens=4)
        assert len(tokens) >= 1
    finally:
        cluster.stop()


def test_systemd_sees_ready_watchdog_and_stopping(tmp_path):
    notify_path = tmp_path / "notify"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(notify_path))
        sock.settimeout(120)
        cluster = LocalCluster(tmp_path, num_instances=1, pool_blocks=16,
                               extra_env={"NOTIFY_SOCKET": str(notify_path), "WATCHDOG_USEC": "1000000"})
        inst = cluster[1]
        try:
            messages = []
            while not any(m.startswith("READY=1") for m in messages):
                messages.append(sock.recv(4096).decode())
            # READY comes once the socket answers and the instance is registered.
            assert inst.status()["instance_id"] == 1
            assert (cluster.state_dir / "members" / "1.json").exists()
            assert "WATCHDOG=1" in sock.recv(4096).decode()  # every 0.5 s
            inst.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                message = sock.recv(4096).decode()
                if message.startswith("STOPPING=1"):
                    break
            else:
                pytest.fail("no STOPPING=1")
            # The stop's last phase asks systemd for its bounded time past TimeoutStopSec.
            while time.monotonic() < deadline:
                message = sock.recv(4096).decode()
                if "EXTEND_TIMEOUT_USEC=" in message:
                    assert message.startswith("STOPPING=1")
                    assert int(message.rsplit("EXTEND_TIMEOUT_USEC=", 1)[1]) >= 30_000_000
                    break
            else:
                pytest.fail("no EXTEND_TIMEOUT_USEC")
            assert inst.process.wait(timeout=60) == 0
            assert not (cluster.state_dir / "members" / "1.json").exists()  # deregistered
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    """A home (1) and two creditors, heartbeats every 0.5 s: the next test kills one creditor
    and the one after it the other, so that one start of the cluster serves both."""
    cluster = LocalCluster(tmp_path_factory.mktemp("trio"), num_instances=3, pool_blocks=POOL_BLOCKS,
                           extra_args=["--heartbeat-interval-s", "0.5"])
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def one_instance_tokens(prompt: str, max_tokens: int) -> list[int]:
    """The undisturbed run: one engine with room for everything, in this process."""
    torch.set_num_threads(1)
    engine = LLMEngine(load_checkpoint(None, show_progress=False),
                       EngineConfig(block_size=16, pool_blocks=(128,), max_num_batched_tokens=128))
    (output,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return list(output.token_ids)


def test_a_killed_creditor_loses_no_request(trio):
    """kill -9 a creditor mid-decode: the home recomputes the KV it held (spilling it on to the
    other creditor), and the request ends as the undisturbed run did, token for token."""
    from infinite_llm.daemon.local_cluster import Generation, wait_for

    cluster = trio
    assert all(inst.process.poll() is None for inst in cluster), "runs before the test below, which kills a creditor"
    home = cluster[1]
    prompt = passkey_prompt(50)  # 752 tokens: more than the home's 40 blocks of 16 hold
    recomputed_before = home.metrics().get("infllm_recompute_seconds_count", 0)
    log_offset = len(home.log_path.read_text())
    # The undisturbed run goes on in a worker thread (one torch thread) beside the cluster's,
    # which keeps the two cores only partly busy. Killed after 20 tokens, the split request
    # decodes 44 more after its recompute (each step over three daemons takes about 0.15 s).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        reference = pool.submit(one_instance_tokens, prompt, 64)
        split = Generation(home, prompt, max_tokens=64, timeout_s=300)
        wait_for("the split request to decode", lambda: len(split.tokens) >= 20, timeout_s=120)
        holder = wait_for("a creditor to hold part of the request's KV",
                          lambda: next((cluster[i] for i in (2, 3) if cluster[i].status()["held_segments"]), None))
        survivor = cluster[5 - holder.inst_id]
        local = Generation(home, "The sky is", max_tokens=60, timeout_s=300)
        os.killpg(holder.process.pid, signal.SIGKILL)
        holder.process.wait(timeout=10)
        assert split.join() == reference.result() and split.finish_reason == "length"
        assert len(split.tokens) == 64
    assert len(local.join()) == 60 and local.finish_reason == "length"
    metrics = home.metrics()
    assert metrics["infllm_segments_recomputed_total"] >= 1
    assert metrics["infllm_tokens_recomputed_total"] >= 16
    assert metrics["infllm_recompute_seconds_count"] == recomputed_before + 1
    assert metrics.get('infllm_requests_finished_total{reason="error"}', 0) == 0
    log = home.log_path.read_text()[log_offset:]
    assert f"instance {holder.inst_id}, which held part of the KV of 1 requests" in log
    # Nothing is left behind: the home's pool is free and the survivor holds nothing.
    wait_for("the survivor to free what it held", lambda: not survivor.status()["held_segments"], timeout_s=30)
    status = home.status()
    assert not status["requests"] and status["pool"]["num_blocks_free"] == POOL_BLOCKS


def test_a_killed_creditor_whose_kv_fits_nowhere_ends_only_its_requests(trio):
    """With the only creditor gone, the home cannot hold the split request's KV: that request
    ends with a clear error, the others go on."""
    from infinite_llm.daemon.local_cluster import Generation, wait_for

    cluster = trio
    home = cluster[1]
    creditors = [cluster[i] for i in (2, 3) if cluster[i].process.poll() is None]
    if len(creditors) == 2:  # run alone: the test above has not killed one of them
        creditors.pop().process.send_signal(signal.SIGTERM)
        assert cluster[3].process.wait(timeout=60) == 0
        time.sleep(2.5)  # an upkeep period, as LocalCluster.wait_ready: the home reads it left
    (creditor,) = creditors
    log_offset = len(home.log_path.read_text())
    split = Generation(home, passkey_prompt(50), max_tokens=400, timeout_s=180)
    wait_for("the home to spill to the creditor", lambda: creditor.status()["held_segments"], timeout_s=120)
    # The split request ends within a second of the kill, the local one a few seconds later.
    local = Generation(home, "The sky is", max_tokens=60, timeout_s=180)
    wait_for("the local request to decode", lambda: len(local.tokens) >= 2, timeout_s=60)
    os.killpg(creditor.process.pid, signal.SIGKILL)
    creditor.process.wait(timeout=10)
    killed_at = time.monotonic()
    split.join()
    assert split.finish_reason == "error" and len(split.tokens) < 400
    assert time.monotonic() - killed_at < 30
    assert local.join() and len(local.tokens) == 60 and local.finish_reason == "length"
    log = home.log_path.read_text()[log_offset:]
    assert f"1 requests ended: instance {creditor.inst_id}, which held part of their KV" in log
    assert "the cluster has no room to recompute it" in log
    assert not home.status()["requests"]
