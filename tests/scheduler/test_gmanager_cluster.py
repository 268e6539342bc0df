"""End to end: two `infinited` processes and a gManager. An imbalance that heartbeats describe
makes the gManager's periodic round send a ``MoveKV`` that the instance carries out and commits;
a deposed leader's command is then refused by the instance.

Instances do not send heartbeats yet: the test sends them, with the real figures of the
instances' pools and of the request that decodes on instance 1.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt
from infinite_llm.daemon.membership import LocalMembership
from infinite_llm.scheduler.election import LeaderInfo, LocalElection
from infinite_llm.scheduler.gmanager import GManager, GManagerConfig, PlannedMove
from infinite_llm.scheduler.perf_model import load_model
from infinite_llm.transport.messages import HeartbeatReply
from gmanager_testlib import PERF_MODEL, GManagerProcess, HeartbeatSender, heartbeat, leader_address

POOL_BLOCKS = 64
PROMPT = passkey_prompt(20, key_item=7)  # about 19 blocks of 16 tokens
MAX_TOKENS = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), num_instances=2, pool_blocks=POOL_BLOCKS)
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


class Generation:
    """A long greedy generation on one instance, abandoned (the instance aborts it) on stop."""

    def __init__(self, instance) -> None:
        self.instance = instance
        self.stopping = threading.Event()
        self.num_steps = 0
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for _ in self.instance.stream(PROMPT, timeout=120, max_tokens=MAX_TOKENS, ignore_eos=True):
            self.num_steps += 1
            if self.stopping.is_set():
                break

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive()


def running_request(instance, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for request in instance.status()["requests"]:
            if request["state"] == "running" and request["num_tokens"] > 300:
                return request
        time.sleep(0.05)
    raise TimeoutError("the request did not start decoding")


def test_imbalance_makes_the_gmanager_move_kv_and_a_deposed_leader_is_refused(cluster, tmp_path) -> None:
    state_dir: Path = cluster.state_dir
    # A leader of epoch 1 came before: the one started here leads with epoch 2.
    (state_dir / "gmanager").mkdir(parents=True, exist_ok=True)
    (state_dir / "gmanager" / "epoch").write_text("1\n")
    gmanager = GManagerProcess(state_dir, "gm", ["--plan-interval-s", "0.5", "--heartbeat-interval-s", "2",
                                                 "--block-size", "16", "--move-timeout-s", "30"])
    sender = HeartbeatSender()
    generation = None
    try:
        assert gmanager.wait_leading()["epoch"] == 2
        sender.start()
        generation = Generation(cluster[1])
        request = running_request(cluster[1])
        req_id = int(request["request_id"])
        local_blocks = sum(len(s["block_ids"]) for s in request["segments"])
        pool_1 = cluster[1].status()["pool"]

        # Instance 1 decodes one long request in its pool; instance 2 is idle.
        peer = leader_address(state_dir)
        free_1 = pool_1["num_blocks_total"] - local_blocks
        reply = sender.send(peer, heartbeat(1, 1, POOL_BLOCKS, free_1, 1, 0, 1, upserts=((req_id, 1, local_blocks),)))
        assert isinstance(reply, HeartbeatReply) and reply.epoch == 2, reply
        reply = sender.send(peer, heartbeat(2, 1, POOL_BLOCKS, POOL_BLOCKS, 0, 0, 1))
        assert isinstance(reply, HeartbeatReply) and reply.epoch == 2, reply

        # The periodic round plans and sends the move; instance 1 commits it at a step boundary.
        deadline = time.monotonic() + 60
        held: list[dict] = []
        while not held and time.monotonic() < deadline:
            held = [s for s in cluster[2].status()["held_segments"]
                    if s["home_instance_id"] == 1 and s["request_id"] == req_id]
            time.sleep(0.1)
        assert held, gmanager.log()
        deadline = time.monotonic() + 30
        while gmanager.status()["moves"].get("committed", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        status = gmanager.status()
        # Instances that send their own heartbeats may let a later round move a little more.
        assert status["moves"].get("committed", 0) >= 1 and set(status["moves"]) == {"committed"}, status
        segments = running_request(cluster[1])["segments"]
        assert segments[0]["instance_id"] == 2 and segments[0]["token_start"] == 0
        assert cluster[1].status()["epoch"] == 2

        # A deposed leader (epoch 1) sends a move down the same path: instance 1 refuses it.
        before = cluster[1].status()["stale_epoch_commands"]
        deposed = GManager(GManagerConfig(state_dir=tmp_path / "deposed", perf_model_path=PERF_MODEL),
                           load_model(PERF_MODEL), LocalElection(tmp_path / "deposed"))
        deposed.transport = sender.transport
        deposed.leadership = LeaderInfo(epoch=1, pid=0, peer_host="", peer_port=0, http_port=0, socket_path="")
        members = LocalMembership(state_dir, stale_after_s=30).members()
        result = sender.run(deposed._send_move(PlannedMove(1, req_id, 1, 2, 1, 0.0), members))
        assert result == "refused"
        assert cluster[1].status()["stale_epoch_commands"] == before + 1
    finally:
        if generation is not None:
            generation.stop()
        sender.close()
        assert gmanager.stop() == 0, gmanager.log()
