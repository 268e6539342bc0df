"""The gManager's drain without processes: heartbeats fed by hand, a fake clock, and a transport
that records every command and answers it. The whole trace of commands is asserted."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from infinite_llm.daemon.membership import LocalMembership, Member
from infinite_llm.scheduler.drain import DrainRefused, UnknownInstance
from infinite_llm.scheduler.election import LeaderInfo, LocalElection
from infinite_llm.scheduler.gmanager import GManager, GManagerConfig
from infinite_llm.scheduler.perf_model import load_model
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.messages import Ack, Drain, MoveKV, Uncordon
from gmanager_testlib import PERF_MODEL, heartbeat

PORT_BASE = 41000  # instance i listens on PORT_BASE + i


class RecordingTransport:
    """Answers every command with Ack and records (receiver, message)."""

    address = PeerAddress("127.0.0.1", 1)

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    async def request(self, peer, message, timeout_s=None):
        self.sent.append((peer.port - PORT_BASE, message))
        return Ack()

    def commands(self) -> list[tuple]:
        """The trace, with the fields that matter (move ids and epochs aside)."""
        out = []
        for inst_id, m in self.sent:
            if isinstance(m, MoveKV):
                out.append((inst_id, "move", m.home_inst_id, m.req_id, m.src_inst_id, m.dst_inst_id, m.num_blocks))
            elif isinstance(m, (Drain, Uncordon)):
                out.append((inst_id, m.TYPE, m.inst_id))
        return out


class HeldElection(LocalElection):
    """Leadership taken by the test: the lock file is never involved."""

    def is_leader(self) -> bool:
        return True


class Cluster:
    """A gManager leading with epoch 4 over three instances described by hand-fed heartbeats."""

    def __init__(self, tmp_path) -> None:
        self.now = 0.0
        self.seq = {1: 0, 2: 0, 3: 0}
        config = GManagerConfig(state_dir=tmp_path, perf_model_path=PERF_MODEL, heartbeat_interval_s=0.02,
                                silent_after_heartbeats=1000)
        self.gm = GManager(config, load_model(PERF_MODEL), HeldElection(tmp_path), clock=lambda: self.now)
        self.gm.leadership = LeaderInfo(epoch=4, pid=os.getpid(), peer_host="127.0.0.1", peer_port=1,
                                        http_port=0, socket_path="")
        self.gm.transport = self.transport = RecordingTransport()
        members = LocalMembership(tmp_path, stale_after_s=3600)
        for inst_id in (1, 2, 3):
            members.publish(Member(inst_id, os.getpid(), "127.0.0.1", PORT_BASE + inst_id, 0, "", 64, 0, False,
                                   time.time()))

    def beat(self, inst_id: int, free: int, batch: int, upserts=(), lent: int = 0, borrowed: int = 0) -> None:
        """A full-state heartbeat of ``inst_id`` at the current time."""
        self.seq[inst_id] += 1
        self.gm.view.receive(heartbeat(inst_id, self.seq[inst_id], 64, free, batch, 0, self.seq[inst_id],
                                       upserts=upserts, lent=lent, borrowed=borrowed), now_s=self.now)


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


def test_drain_refusals_plan_moves_and_safe_to_stop(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    # Instance 1 runs request 7: 24 blocks at home, 12 on instance 2, 9 on 3. Instance 2 runs
    # request 5 with 10 blocks at home. Instance 3 has only 5 free blocks at first.
    c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 2, 12), (7, 3, 9)), borrowed=21)
    c.beat(2, 30, 1, upserts=((5, 2, 10),), lent=12)
    c.beat(3, 5, 0, lent=9)

    async def scenario() -> None:
        with pytest.raises(UnknownInstance, match="unknown instance 9"):
            await gm.drain(9, dry_run=False)
        # Request 7's 12 blocks may go only to 3 (1 is their home), which has 5 free: refused.
        with pytest.raises(DrainRefused, match="request 7 of instance 1 has 12 blocks on instance 2"):
            await gm.drain(2, dry_run=False)
        assert c.transport.sent == [] and gm.drain_status(2)["draining"] is False

        c.now = 1.0
        c.beat(3, 50, 0, lent=9)
        plan = await gm.drain(2, dry_run=True)
        assert [(m["home_inst_id"], m["req_id"], m["src_inst_id"], m["dst_inst_id"], m["num_blocks"], m["kind"])
                for m in plan["moves"]] == [(1, 7, 2, 3, 12, "held"), (2, 5, 2, 1, 9, "own")]
        assert c.transport.sent == []

        report = await gm.drain(2, dry_run=False)
        assert report["draining"] and report["state"] == "draining" and not report["safe_to_stop"]
        await until(lambda: len(gm.drain_status(2)["moves"]) == 2)
        # Cordon first; then each move goes to the request's home, which carries it out.
        assert c.transport.commands() == [(2, "drain", 2), (1, "move", 1, 7, 2, 3, 12), (2, "move", 2, 5, 2, 1, 9)]
        assert {m.epoch for _, m in c.transport.sent} == {4}
        assert [m["result"] for m in gm.drain_status(2)["moves"]] == ["committed", "committed"]
        # While it drains, instance 2 is no creditor: not in hints, not in the policy's room.
        assert all(i["draining"] == (i["instance_id"] == 2) for i in gm.status()["instances"])
        hints = gm.view.creditor_hints(c.now, 1, 3)
        assert 2 in {h.inst_id for h in hints}  # the view alone would name it
        c.now = 1.5
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21)
        reply = await gm.handle(heartbeat(3, 100, 64, 38, 0, 0, 1, lent=21))
        assert 2 not in {h.inst_id for h in reply.creditors}

        # Newer heartbeats: the segment moved; request 5 still runs on 2 with one block at home.
        c.now = 2.0
        c.beat(1, 31, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21, lent=9)
        c.beat(2, 63, 1, upserts=((5, 2, 1), (5, 1, 9)), borrowed=9)
        await until(lambda: gm.drain_status(2)["rounds"] >= 1)
        status = gm.drain_status(2)
        assert (status["running_requests"], status["blocks_held_for_others"], status["safe_to_stop"]) == (1, 0, False)
        assert len(c.transport.sent) == 3  # nothing more to move: one block stays where it is written

        # Request 5 finished: nothing runs on 2 and nothing is held there.
        c.now = 3.0
        c.beat(2, 64, 0)
        c.beat(1, 40, 1, upserts=((7, 1, 24), (7, 3, 21)), borrowed=21)
        await until(lambda: gm.drain_status(2)["safe_to_stop"])
        assert gm.drain_status(2)["state"] == "safe_to_stop"

        assert await gm.uncordon(2) == {"instance_id": 2, "draining": False}
        assert c.transport.commands()[-1] == (2, "uncordon", 2)
        assert gm.drain_status(2)["draining"] is False
        with pytest.raises(UnknownInstance):
            await gm.uncordon(9)

    asyncio.run(scenario())


def test_the_policy_places_nothing_on_a_draining_instance(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    # Instance 1 is a debtor with a long request; 2 and 3 are empty.
    c.beat(1, 0, 1, upserts=((7, 1, 64),))
    c.beat(2, 64, 0)
    c.beat(3, 64, 0)

    async def scenario() -> None:
        before = {m["dst_inst_id"] for m in (await gm.rebalance(dry_run=True))["moves"]}
        assert before, "the imbalance should make the policy move blocks"
        await gm.drain(3, dry_run=False)
        after = {m["dst_inst_id"] for m in (await gm.rebalance(dry_run=True))["moves"]}
        assert after and 3 not in after
        gm._drains[3].task.cancel()

    asyncio.run(scenario())
