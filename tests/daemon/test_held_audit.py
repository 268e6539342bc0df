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


def blocks_freed_by_one_audit(s: Setup, creditor, inst_id: int) -> int:
    """H started, serving audits; then ``creditor`` (instance ``inst_id``) audits H once."""
    async def scenario() -> int:
        await start_home_serving_audits(s)
        return (await audit_held(creditor.transport, creditor.ledger, inst_id, H, address(H), timeout_s=5.0))[0]
    return run(scenario())


def test_a_segment_whose_free_was_lost_is_freed_by_the_audit() -> None:
    s = Setup()
    s.bm.free("7")  # the request ended; its FreeSegment to D never arrived
    assert blocks_freed_by_one_audit(s, s.d, D) == 2
    assert s.d.ledger.held == {} and sorted(s.d.free) == [5, 6, 7]
    assert s.types() == [(D, H, "audit_held"), (H, D, "audit_held_reply")]


def test_the_segments_a_home_counts_on_stay_held() -> None:
    s = Setup()
    assert blocks_freed_by_one_audit(s, s.d, D) == 0
    assert list(s.d.ledger.held) == [(H, 7, 0)]


def test_a_creditor_holding_nothing_for_the_home_asks_nothing() -> None:
    s = Setup()
    assert blocks_freed_by_one_audit(s, s.x, X) == 0
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
        await transport.request(address(H), AuditHeld(stranger, (HeldSegmentRef(7, 0, 1),)))

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
                (await audit_held(s.x.transport, s.x.ledger, X, H, address(H), timeout_s=5.0))[0])
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
        return moved, (await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0))[0]

    moved, freed_on_d = run(scenario())
    assert moved and audits_during_commit == [0]
    assert list(s.x.ledger.held) == [(H, 7, 0)]
    assert freed_on_d == 2 and s.d.ledger.held == {}
    assert s.bm.block_table("7")[0].instance_id == s.dst.engine_id


def test_a_free_that_comes_after_the_audit_leaves_a_newer_copy_alone(monkeypatch) -> None:
    """H moves its segment from D to X, and its free for D's copy fails once (sent again later).
    D's audit frees that copy meanwhile; H moves the segment back to D, which commits a new copy
    under the same segment id. The late free names the old copy: the new one stays."""
    from infinite_llm.daemon import peers as peers_module
    from infinite_llm.transport.errors import PeerUnreachable

    monkeypatch.setattr(peers_module, "FREE_RETRY_PAUSES_S", (0.2,))
    s = Setup()
    send = s.home.send
    failed: list[FreeSegment] = []

    async def first_free_to_d_fails(peer, message, *, timeout_s=None):
        if isinstance(message, FreeSegment) and peer == address(D) and not failed:
            failed.append(message)
            raise PeerUnreachable(peer, "connection reset")
        return await send(peer, message, timeout_s=timeout_s)
    s.home.send = first_free_to_d_fails

    async def scenario() -> None:
        await start_home_serving_audits(s)
        assert await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4)  # D -> X
        await s.network.settle()
        assert failed and (H, 7, 0) in s.d.ledger.held  # the free is to be sent again
        freed, _ = await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0)
        assert freed == 2 and s.d.ledger.held == {}
        assert await s.lender.move_held(s.engine, "7", 2, s.dst, s.src, epoch=5)  # X -> D
        await s.network.settle()
        new_copy = s.d.ledger.held[(H, 7, 0)]
        assert s.bm.block_table("7")[0].copy_id == new_copy.reservation_id != failed[0].reservation_id
        await asyncio.sleep(0.4)  # the free is sent again, and arrives
        await s.network.settle()
        await s.lender.close()
        assert (H, D, "free_segment") in s.types()
        assert s.d.ledger.held == {(H, 7, 0): new_copy}

    run(scenario())


def test_a_home_with_more_segments_than_one_audit_names_is_audited_in_turns(monkeypatch) -> None:
    from infinite_llm.daemon import peers as peers_module

    monkeypatch.setattr(peers_module, "MAX_AUDITED_SEGMENTS", 2)
    s = Setup()
    # Four more segments of ended requests 8..11 are held on D (a block each); their frees
    # never came.
    s.d.free.extend(range(4))
    for req_id in (8, 9, 10, 11):
        reservation = s.d.ledger.reserve(H, req_id, 1, 0.0)
        s.d.ledger.commit(reservation.reservation_id, H, req_id, 0, 0.0)

    async def scenario() -> list[tuple[int, tuple[int, int] | None]]:
        await start_home_serving_audits(s)
        turns, after = [], None
        for _ in range(4):
            freed, after = await audit_held(s.d.transport, s.d.ledger, D, H, address(H), timeout_s=5.0, after=after)
            turns.append((freed, after))
        return turns

    # Two segments a turn, in request order, each turn going on after the last one named: 7 and
    # 8 (8 freed), then 9 and 10 (both freed), then 11 (freed, the last: from the start again),
    # then 7 alone.
    assert run(scenario()) == [(1, (8, 0)), (2, (10, 0)), (1, None), (0, None)]
    assert list(s.d.ledger.held) == [(H, 7, 0)]
