"""The gManager's rounds without processes: heartbeats fed by hand, a fake clock, and a
transport that records every command (and answers it, or stands for an instance that does not)."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from infinite_llm.scheduler.gmanager import AdminApp, MovesUnsettled
from infinite_llm.transport.errors import PeerUnreachable, RequestTimeout
from gmanager_testlib import PORT_BASE, Cluster, RecordingTransport, until


def moves_of(report: dict) -> list[tuple]:
    return [(m["home_inst_id"], m["req_id"], m["src_inst_id"], m["dst_inst_id"], m["num_blocks"], m["result"])
            for m in report["moves"]]


async def post_rebalance(c: Cluster, body: dict) -> tuple[int, dict]:
    async with TestClient(TestServer(AdminApp(c.gm).build())) as client:
        response = await client.post("/v1/rebalance", json=body)
        return response.status, await response.json()


def test_a_round_waits_for_heartbeats_newer_than_the_last_moves(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.one_debtor_two_empty()

    async def scenario() -> None:
        c.now = 1.0
        assert moves_of(await gm.rebalance(dry_run=False)) == [(1, 7, 1, 2, 32, "committed")]
        # No heartbeat since: the figures still show all 64 blocks on instance 1.
        c.now = 1.1
        assert gm.unsettled_instances() == [1, 2]
        with pytest.raises(MovesUnsettled, match=r"instance\(s\) 1, 2"):
            await gm.rebalance(dry_run=False)
        code, body = await post_rebalance(c, {"dry_run": False})
        assert code == 409 and "not yet in the heartbeats of instance(s) 1, 2" in body["error"]
        code, body = await post_rebalance(c, {"dry_run": True})  # a dry run sends nothing: allowed
        assert code == 200 and [m["result"] for m in body["moves"]] == ["not_sent"]
        assert len(c.transport.sent) == 1

        # Instance 1 reports the move; 2 has not spoken yet.
        c.now = 1.5
        c.beat(1, 32, 1, upserts=((7, 1, 32), (7, 2, 32)), borrowed=32)
        with pytest.raises(MovesUnsettled, match=r"instance\(s\) 2:"):
            await gm.rebalance(dry_run=False)
        c.beat(2, 32, 0, lent=32)
        assert gm.moves_settled()
        # Planned from figures that show the first move: the request is split evenly already.
        assert (await gm.rebalance(dry_run=False))["moves"] == []
        assert c.transport.commands() == [(1, "move", 1, 7, 1, 2, 32)]

    asyncio.run(scenario())


def test_a_move_under_way_holds_off_the_next_round(tmp_path) -> None:
    c = Cluster(tmp_path)
    gm = c.gm
    c.one_debtor_two_empty()

    class SlowTransport(RecordingTransport):
        """Answers once the test lets it: a move waiting for its commit."""

        def __init__(self) -> None:
            super().__init__()
            self.commit = asyncio.Event()

        async def request(self, peer, message, timeout_s=None):
            reply = await super().request(peer, message, timeout_s)
            await self.commit.wait()
            return reply

    async def scenario() -> None:
        gm.transport = c.transport = SlowTransport()
        c.now = 1.0
        round_one = asyncio.create_task(gm.rebalance(dry_run=False))
        await until(lambda: len(c.transport.sent) == 1)
        # Heartbeats during the move predate its commit.
        c.now = 1.5
        c.beat(1, 0, 1, upserts=((7, 1, 64),))
        c.beat(2, 64, 0)
        assert gm.unsettled_instances() == [1, 2]
        c.transport.commit.set()
        await round_one
        assert gm.unsettled_instances() == [1, 2]
        c.now = 2.0
        c.beat(1, 32, 1, upserts=((7, 1, 32), (7, 2, 32)), borrowed=32)
        c.beat(2, 32, 0, lent=32)
        assert gm.moves_settled()

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["timeout", "unreachable"])
def test_an_instance_that_does_not_answer_gets_no_more_moves_in_the_round(tmp_path, failure) -> None:
    c = Cluster(tmp_path, move_timeout_s=30.0)
    gm = c.gm

    class SilentInstanceOne(RecordingTransport):
        async def request(self, peer, message, timeout_s=None):
            self.sent.append((peer.port - PORT_BASE, message))
            if failure == "timeout":
                raise RequestTimeout(peer, message.TYPE, timeout_s)
            raise PeerUnreachable(peer, "connection refused")

    gm.transport = c.transport = SilentInstanceOne()
    # Instance 1 runs eight requests in a full pool: the policy moves several of them.
    c.beat(1, 0, 8, upserts=tuple((r, 1, 8) for r in range(8)))
    c.beat(2, 64, 0)
    c.beat(3, 64, 0)

    async def scenario() -> None:
        planned = len((await gm.rebalance(dry_run=True))["moves"])
        assert planned > 2
        results = [m["result"] for m in (await gm.rebalance(dry_run=False))["moves"]]
        assert results == [failure] + ["skipped"] * (planned - 1)
        assert len(c.transport.sent) == 1
        assert gm.status()["moves"] == {failure: 1, "skipped": planned - 1}

    asyncio.run(scenario())
