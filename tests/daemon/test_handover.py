"""The stop hand-over's parts in one process: the leader record, the drain request on a Unix
socket and on TCP against a stand-in admin API, the retry rules and the held-block counts."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path

from aiohttp import web

from infinite_llm.daemon.handover import (
    DrainAnswer,
    HandOver,
    LeaderAdmin,
    blocks_held_by_home,
    describe_held,
    leader_admin_local,
    request_drain,
)
from infinite_llm.daemon.ledger import CreditorLedger


class FakeLeaderAdmin:
    """``POST /v1/drain`` answering with a fixed status; records the bodies it got."""

    def __init__(self, status: int = 200, body: dict | None = None) -> None:
        self.status = status
        self.body = body if body is not None else {"state": "draining", "planned_moves": [{}, {}]}
        self.requests: list[dict] = []
        self.runner: web.AppRunner | None = None
        self.http_port = 0

    async def post_drain(self, request: web.Request) -> web.Response:
        self.requests.append(await request.json())
        return web.json_response(self.body, status=self.status)

    async def start(self, socket_path: Path | None = None) -> None:
        app = web.Application()
        app.router.add_post("/v1/drain", self.post_drain)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        if socket_path is not None:
            await web.UnixSite(self.runner, str(socket_path)).start()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await self.runner.cleanup()


def run(coroutine, timeout_s: float = 20.0):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coroutine
    return asyncio.run(bounded())


def test_leader_record_of_the_local_election(tmp_path: Path) -> None:
    assert leader_admin_local(tmp_path) is None
    folder = tmp_path / "gmanager"
    folder.mkdir()
    record = {"epoch": 4, "pid": os.getpid(), "peer_host": "127.0.0.1", "peer_port": 9, "http_port": 8300,
              "socket_path": "/run/gm.sock"}
    (folder / "leader.json").write_text(json.dumps(record))
    assert leader_admin_local(tmp_path) == LeaderAdmin(4, "127.0.0.1", 8300, "/run/gm.sock")
    (folder / "leader.json").write_text(json.dumps({**record, "pid": 2**22 + 12345}))  # no such process
    assert leader_admin_local(tmp_path) is None
    (folder / "leader.json").write_text("{not json")
    assert leader_admin_local(tmp_path) is None


def test_drain_request_over_the_socket_then_tcp(tmp_path: Path) -> None:
    async def scenario():
        leader = FakeLeaderAdmin()
        await leader.start(tmp_path / "gm.sock")
        try:
            by_socket = await request_drain(LeaderAdmin(1, "127.0.0.1", 0, str(tmp_path / "gm.sock")), 2, 5.0)
            # A socket path of no listener (another host's leader): TCP still reaches it.
            (tmp_path / "stale.sock").touch()
            by_tcp = await request_drain(LeaderAdmin(1, "127.0.0.1", leader.http_port, str(tmp_path / "stale.sock")),
                                         2, 5.0)
            # The same path on this host may be a standby replica's, with the leader elsewhere.
            standby = FakeLeaderAdmin(503, {"error": "pid 7 is a standby; only the leader drains"})
            await standby.start(tmp_path / "standby.sock")
            try:
                past_standby = await request_drain(
                    LeaderAdmin(1, "127.0.0.1", leader.http_port, str(tmp_path / "standby.sock")), 2, 5.0)
            finally:
                await standby.stop()
        finally:
            await leader.stop()
        return by_socket, by_tcp, past_standby, leader.requests
    by_socket, by_tcp, past_standby, requests = run(scenario())
    assert by_socket == by_tcp == past_standby == DrainAnswer("accepted", "draining", 2)
    assert requests == [{"instance_id": 2, "own_blocks": False}] * 3


def test_refusal_and_unreachable_leader_are_answers_not_errors(tmp_path: Path) -> None:
    async def scenario():
        leader = FakeLeaderAdmin(409, {"error": "drain refused, nothing moved: no room"})
        await leader.start()
        try:
            refused = await request_drain(LeaderAdmin(1, "127.0.0.1", leader.http_port, ""), 2, 5.0)
        finally:
            await leader.stop()
        gone = await request_drain(LeaderAdmin(1, "127.0.0.1", leader.http_port, ""), 2, 2.0)
        nothing = await request_drain(LeaderAdmin(1, "127.0.0.1", 0, ""), 2, 2.0)
        return refused, gone, nothing
    refused, gone, nothing = run(scenario())
    assert refused == DrainAnswer("refused", "409: drain refused, nothing moved: no room")
    assert gone.outcome == "failed" and "127.0.0.1:" in gone.detail
    assert nothing == DrainAnswer("failed", "the leader record names no admin API")


def test_hand_over_asks_again_until_accepted_and_again_for_a_new_leader(tmp_path: Path, caplog) -> None:
    async def scenario():
        leader = FakeLeaderAdmin(404, {"error": "unknown instance 2 (no recent heartbeat)"})
        await leader.start()
        current: list[LeaderAdmin | None] = [None]
        handover = HandOver(2, lambda: current[0], request_timeout_s=5.0, retry_s=1.0)
        try:
            await handover.ask_if_due(0.0, 100.0, "3 blocks")  # no leader known
            assert handover.last_answer == DrainAnswer("failed", "no gManager leader is known")
            current[0] = LeaderAdmin(5, "127.0.0.1", leader.http_port, "")
            await handover.ask_if_due(0.5, 100.0, "3 blocks")  # too early to ask again
            assert leader.requests == []
            await handover.ask_if_due(1.0, 100.0, "3 blocks")  # 404: not heard of yet
            await handover.ask_if_due(1.5, 100.0, "3 blocks")
            assert len(leader.requests) == 1 and handover.accepted_epoch is None
            leader.status, leader.body = 200, {"state": "draining", "planned_moves": [{}]}
            await handover.ask_if_due(2.0, 100.0, "3 blocks")
            assert handover.accepted_epoch == 5
            await handover.ask_if_due(9.0, 100.0, "3 blocks")  # accepted: not asked again
            assert len(leader.requests) == 2
            current[0] = LeaderAdmin(6, "127.0.0.1", leader.http_port, "")  # drains are the leader's soft state
            await handover.ask_if_due(10.0, 100.0, "3 blocks")
            assert len(leader.requests) == 3 and handover.accepted_epoch == 6
        finally:
            await leader.stop()
    with caplog.at_level(logging.INFO, logger="infinite_llm.daemon.handover"):
        run(scenario())
    messages = [r.getMessage() for r in caplog.records]
    assert any("no gManager leader is known" in m and r.levelno == logging.WARNING
               for m, r in zip(messages, caplog.records))
    assert sum("404: unknown instance 2" in m for m in messages) == 1  # logged once, not per retry
    assert any("the gManager leader (epoch 6) drains instance 2 to move 3 blocks elsewhere (1 moves planned)" in m
               for m in messages)


def test_blocks_held_by_home_counts_segments_and_reservations() -> None:
    free_ids = list(range(20))
    ledger = CreditorLedger(lambda n: [free_ids.pop(0) for _ in range(n)] if n <= len(free_ids) else None,
                            lambda ids: free_ids.extend(ids), reservation_ttl_s=10.0)
    assert blocks_held_by_home(ledger) == {}
    first = ledger.reserve(1, 7, 3, now=0.0)
    ledger.commit(first.reservation_id, 1, 7, 0, now=0.0)
    second = ledger.reserve(1, 7, 2, now=0.0)
    ledger.commit(second.reservation_id, 1, 7, 3, now=0.0)
    ledger.reserve(3, 9, 4, now=0.0)  # not committed yet: its blocks count, no segment yet
    by_home = blocks_held_by_home(ledger)
    assert by_home == {1: (2, 5), 3: (0, 4)}
    assert describe_held(by_home) == "5 blocks in 2 segments for instance 1, 4 blocks in 0 segments for instance 3"
