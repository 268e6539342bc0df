"""A creditor's audit of the segments it holds for a home, on the in-memory transport: the home H
answers with ``TransportLender.stale_held``, the creditor runs ``audit_held``. A segment whose
FreeSegment was lost is freed; one the home's table points at, or that a move of the home is
landing on the auditing creditor, is kept."""

from __future__ import annotations

import asyncio

import pytest

from infinite_llm.daemon.peers import audit_held
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.messages import AuditHeld, FreeSegment, HeldSegmentRef, MoveCommit

from test_move_held import D, H, X, Setup, address


def run(coroutine):
    async def bounded():
        async with asyncio.timeout(20):
            return await coroutine
    return asyncio.run(bounded())


def start_home_serving_audits(s: Setup):
    async def start() -> None:
        await s.d.start()
        await s.x.start()

        async def serve(message):
            if isinstance(message, AuditHeld):
                return s.lender.stale_held(s.engine, message)
            raise ValueError(f"not served: {message.TYPE}")
        await s.home.start(serve)
    return start()


def test_a_segment_whose_free_was_lost_is_freed_by_the_audit() -> None:
    s = Setup()
    s.bm.free("7")  # the request ended; its FreeSegment to D never arrived

    async def scenario() -> int:
        await start_home_serving_audits(s)
        return await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0)

    assert run(scenario()) == 2
    assert s.d.ledger.held == {} and sorted(s.d.free) == [5, 6, 7]
    assert s.types() == [(D, H, "audit_held"), (H, D, "audit_held_reply")]


def test_the_segments_a_home_counts_on_stay_held() -> None:
    s = Setup()

    async def scenario() -> int:
        await start_home_serving_audits(s)
        return await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0)

    assert run(scenario()) == 0
    assert list(s.d.ledger.held) == [(H, 7, 0)]


def test_a_creditor_holding_nothing_for_the_home_asks_nothing() -> None:
    s = Setup()

    async def scenario() -> int:
        await start_home_serving_audits(s)
        return await audit_held(s.x.transport, s.x.ledger, X, H, address(H), timeout_s=5.0)

    assert run(scenario()) == 0
    assert s.types() == []


def test_an_audit_from_a_creditor_the_home_does_not_know_frees_nothing() -> None:
    s = Setup()
    s.bm.free("7")
    stranger = 9
    transport = s.network.transport(address(stranger))

    async def scenario() -> None:
        await start_home_serving_audits(s)

        async def serves_nothing(message):
            raise ValueError("serves nothing")
        await transport.start(serves_nothing)
        # The stranger claims to hold the segment: the home cannot say which of its tables
        # would point at it, so it answers with an error and the stranger frees nothing.
        await transport.request(address(H), AuditHeld(stranger, (HeldSegmentRef(7, 0),)))

    with pytest.raises(RemoteError, match="not a peer"):
        run(scenario())


def test_a_relocation_landing_on_the_auditor_counts_as_the_homes() -> None:
    """X commits the copy before H switches its table to X: an audit from X in between (here,
    while X answers the commit) finds the copy counted on. After the switch, D's copy is stale:
    with D's FreeSegment lost, D's audit frees it."""
    s = Setup()
    audits_during_commit: list[int] = []
    serve_x = s.x.handle

    async def audit_while_committing(message):
        reply = await serve_x(message)
        if isinstance(message, MoveCommit):
            audits_during_commit.append(
                await audit_held(s.x.transport, s.x.ledger, X, H, address(H), timeout_s=5.0))
        return reply
    s.x.handle = audit_while_committing
    serve_d = s.d.handle

    async def lose_frees(message):
        if isinstance(message, FreeSegment):
            return None
        return await serve_d(message)
    s.d.handle = lose_frees

    async def scenario() -> tuple[bool, int]:
        await start_home_serving_audits(s)
        moved = await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4)
        await s.network.settle()
        return moved, await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0)

    moved, freed_on_d = run(scenario())
    assert moved and audits_during_commit == [0]
    assert list(s.x.ledger.held) == [(H, 7, 0)]
    assert freed_on_d == 2 and s.d.ledger.held == {}
    assert s.bm.block_table("7")[0].instance_id == s.dst.engine_id
