"""Defects a review found in the in-memory transport, the codec, the messages' checks and the
shared-memory regions, each pinned by a test that failed before its fix."""

from __future__ import annotations

import asyncio
import gc
import os
import subprocess
import sys
import textwrap

import orjson
import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import PeerUnreachable, ProtocolError, RemoteError, RequestTimeout
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.memory import FakeClock, InMemoryNetwork
from infinite_llm.transport.shared_memory import SharedRegion

A, B, C = (PeerAddress("memory", i) for i in (1, 2, 3))
LIMITS = codec.FrameLimits()


def run(coroutine):
    async def bounded():
        async with asyncio.timeout(10):  # real seconds: only a bug takes this long
            return await coroutine
    return asyncio.run(bounded())


async def spin(rounds: int = 50) -> None:
    for _ in range(rounds):
        await asyncio.sleep(0)


async def ignore(message: m.Message) -> m.Message | None:
    return None


def waiting_on(go: asyncio.Event):
    """A handler that answers (an Ack) once ``go`` is set."""
    async def handler(message: m.Message) -> m.Message | None:
        await go.wait()
        return None
    return handler


# --- the in-memory transport: replies, kills, closes -----------------------------------------


def test_a_late_reply_to_a_killed_requester_never_answers_its_restarted_successor():
    """The restarted transport's ids start at 1 again: B's late answer to the dead one's request
    1 must not answer the new one's request 1 (to another peer). On UCX a reply only travels on
    its request's connection."""
    async def scenario():
        net = InMemoryNetwork()
        release = asyncio.Event()

        async def slow(message: m.Message) -> m.Message | None:
            await release.wait()
            return m.KVHoldReply(num_blocks_held=3, num_blocks_free=7)

        async def never(message: m.Message) -> m.Message | None:
            await asyncio.Event().wait()

        a1, b, c = net.transport(A), net.transport(B), net.transport(C)
        await a1.start(ignore)
        await b.start(slow)
        await c.start(never)
        old = asyncio.ensure_future(a1.request(B, m.HoldKV(home_inst_id=1, req_id=5, num_blocks=3), timeout_s=60))
        await spin()
        net.kill(A)
        with pytest.raises(PeerUnreachable):
            await old
        a2 = net.transport(A)
        await a2.start(ignore)
        new = asyncio.ensure_future(a2.request(C, m.Drain(epoch=1, drain_id=9, inst_id=3), timeout_s=60))
        await spin()
        release.set()
        await spin()
        assert not new.done()  # C never answers: nothing else may
        late = [e for e in net.trace if e.message_type == "kv_hold_reply"]
        assert [(str(e.src), str(e.dst), e.outcome) for e in late] == [("memory:2", "memory:1", "unreachable")]
        new.cancel()
    run(scenario())


def test_a_killed_transport_finishes_no_handler_and_sends_nothing():
    async def scenario():
        net = InMemoryNetwork()
        go = asyncio.Event()
        finished: list[str] = []
        cancelled: list[str] = []

        async def slow(message: m.Message) -> m.Message | None:
            try:
                await go.wait()
            except asyncio.CancelledError:
                cancelled.append(message.TYPE)
                raise
            finished.append(message.TYPE)
            return m.Ack()

        a, b = net.transport(A), net.transport(B)
        await a.start(ignore)
        await b.start(slow)
        request = asyncio.ensure_future(a.request(B, m.Drain(epoch=1, drain_id=1, inst_id=2), timeout_s=60))
        await spin()
        net.kill(B)
        go.set()
        await net.settle()
        with pytest.raises(PeerUnreachable):
            await request
        assert finished == [] and cancelled == ["drain"]
        assert [(e.message_type, e.outcome) for e in net.trace] == [("drain", "delivered")]
    run(scenario())


def test_a_closed_transport_answers_nothing_and_its_requesters_hear_at_once():
    async def scenario():
        net = InMemoryNetwork()
        go = asyncio.Event()
        a, b = net.transport(A), net.transport(B)
        await a.start(ignore)
        await b.start(waiting_on(go))
        request = asyncio.ensure_future(a.request(B, m.Drain(epoch=1, drain_id=1, inst_id=2), timeout_s=60))
        await spin()
        await b.close()
        go.set()
        await net.settle()
        assert request.done()  # as UCX drops a closed listener's connections: no timeout
        with pytest.raises(PeerUnreachable):
            await request
        assert [e.message_type for e in net.trace] == ["drain"]
    run(scenario())


def test_a_handler_of_a_killed_transport_cannot_send():
    async def scenario():
        net = InMemoryNetwork()
        a, b, c = net.transport(A), net.transport(B), net.transport(C)
        seen: list[str] = []
        go = asyncio.Event()
        outcome: list[str] = []

        async def record(message: m.Message) -> m.Message | None:
            seen.append(message.TYPE)
            return None

        await a.start(ignore)
        await b.start(waiting_on(go))
        await c.start(record)
        await a.send(B, m.Ack())
        await spin()
        net.kill(B)
        try:
            await b.send(C, m.Ack())  # what a handler of the killed one would still try
        except PeerUnreachable:
            outcome.append("refused")
        await net.settle()
        assert outcome == ["refused"] and seen == []
    run(scenario())


# --- the in-memory transport: refused frames answer at once, as on UCX -------------------------


SMALL = TransportConfig(limits=codec.FrameLimits(max_buffer_bytes=1024, max_total_buffer_bytes=1024))
REFUSED = {
    "over the receiver's cap": (m.Echo(torch.zeros(4096, dtype=torch.uint8)), m.ErrorCode.BUFFER_TOO_LARGE),
    "a bool in an int field": (m.Drain(epoch=True, drain_id=1, inst_id=2), m.ErrorCode.INVALID_FIELDS),
    "an id >= 2**63": (m.FreeSegment(home_inst_id=1, req_id=2**63, segment_id=0, reservation_id=1),
                       m.ErrorCode.INVALID_FIELDS),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_frame_the_receiver_refuses_fails_its_request_at_once_as_on_ucx(case):
    message, code = REFUSED[case]

    async def scenario():
        clock = FakeClock()
        net = InMemoryNetwork(clock)
        go = asyncio.Event()

        async def handle(request: m.Message) -> m.Message | None:
            if isinstance(request, m.Drain) and request.drain_id == 500:
                await go.wait()
            return None

        a, b = net.transport(A), net.transport(B, SMALL)
        await a.start(ignore)
        await b.start(handle)
        other = asyncio.ensure_future(a.request(B, m.Drain(epoch=1, drain_id=500, inst_id=2), timeout_s=5))
        await spin()
        refused = asyncio.ensure_future(a.request(B, message, timeout_s=5))
        await spin()
        assert refused.done() and other.done()  # the clock did not move
        with pytest.raises(RemoteError) as info:
            await refused
        assert info.value.code == code
        with pytest.raises(PeerUnreachable, match="refused a frame"):  # UCX closes that connection
            await other
        go.set()
        assert await a.request(B, m.Drain(epoch=1, drain_id=1, inst_id=2)) == m.Ack()  # serves on
        await net.settle()
    run(scenario())


def test_a_refused_one_way_message_fails_the_requests_in_flight_to_that_peer():
    async def scenario():
        net = InMemoryNetwork()
        go = asyncio.Event()
        a, b = net.transport(A), net.transport(B, SMALL)
        await a.start(ignore)
        await b.start(waiting_on(go))
        pending = asyncio.ensure_future(a.request(B, m.Drain(epoch=1, drain_id=1, inst_id=2), timeout_s=5))
        await spin()
        await a.send(B, m.Echo(torch.zeros(4096, dtype=torch.uint8)))
        await spin()
        assert pending.done()
        with pytest.raises(PeerUnreachable, match="buffer_too_large"):
            await pending
        go.set()
        await net.settle()
    run(scenario())


def test_a_reply_the_requester_refuses_fails_its_request_at_once():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A, SMALL), net.transport(B)
        await a.start(ignore)
        await b.start(lambda request: m.EchoReply(torch.zeros(4096, dtype=torch.uint8)))
        request = asyncio.ensure_future(a.request(B, m.Echo(torch.zeros(4, dtype=torch.uint8)), timeout_s=5))
        await net.settle()
        assert request.done()
        with pytest.raises(PeerUnreachable, match="buffer_too_large"):
            await request
    run(scenario())


# --- the codec: headers over the limit, specs, versions, flags -------------------------------


BIG_RESERVED = m.MoveReserved(move_id=1, reservation_id=1, dst_block_ids=tuple(range(100_000, 300_000)),
                              expires_in_ms=5000)


def test_encode_refuses_a_header_over_the_limit_it_is_given():
    with pytest.raises(codec.HeaderTooLarge, match="move_reserved header of .* over the 1048576-byte limit"):
        codec.encode(BIG_RESERVED, 1)  # the default: FrameLimits' 1 MiB
    assert issubclass(codec.HeaderTooLarge, ValueError)
    frame = codec.encode(BIG_RESERVED, 1, max_header_bytes=4 << 20)
    assert codec.decode_header(frame.header, codec.FrameLimits(max_header_bytes=4 << 20)).message == BIG_RESERVED
    small = codec.encode(m.Ack(), 1)
    with pytest.raises(codec.HeaderTooLarge):
        codec.encode(m.Ack(), 1, max_header_bytes=len(small.header) - 1)
    assert codec.encode(m.Ack(), 1, max_header_bytes=len(small.header)).header == small.header
    # Inline buffers count: they travel inside the header.
    with pytest.raises(codec.HeaderTooLarge):
        codec.encode(m.Echo(torch.zeros(4096, dtype=torch.uint8)), 1, max_header_bytes=4096)


def test_in_memory_a_reply_over_the_header_limit_is_an_error_reply_and_a_request_raises():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        await a.start(ignore)
        await b.start(lambda request: BIG_RESERVED)
        request = asyncio.ensure_future(a.request(B, m.TryMoveKV(0, 1, 1, 1, 1, 200_000, 4096), timeout_s=5))
        await net.settle()
        assert request.done()
        with pytest.raises(RemoteError) as info:
            await request
        assert info.value.code == m.ErrorCode.HANDLER_FAILED and "HeaderTooLarge" in info.value.detail
        with pytest.raises(codec.HeaderTooLarge):
            await a.request(B, BIG_RESERVED)
        assert a._pending == {}  # nothing left waiting for the request that never left
    run(scenario())


def test_an_unencodable_reply_says_why_in_a_bounded_detail():
    reply = codec.unencodable_reply(m.Ack(), ValueError("x" * 100_000))
    assert len(reply.detail) <= 2000
    codec.encode(reply, 1)


def _header(body: dict, flags: int = codec.FLAG_WANTS_REPLY) -> bytes:
    data = orjson.dumps(body)
    return codec.header_bytes(data, flags=flags)


def _echo_spec(shape: list[int]) -> dict:
    return {"t": "echo", "v": 1, "id": 1, "re": None, "f": {}, "x": {"payload": ["float32", shape]}, "b": [[0, 1]]}


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [0, 2**40], [2**40, 0], [0, 1 << 31, 1 << 31, 4]])
def test_an_empty_tensor_whose_other_dimensions_are_huge_is_refused(shape):
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(_header(_echo_spec(shape)), LIMITS)
    assert info.value.code == m.ErrorCode.BUFFER_TOO_LARGE


def test_an_empty_tensor_within_the_cap_still_travels():
    header = codec.decode_header(_header(_echo_spec([0, 1024, 16])), LIMITS)
    assert header.specs[0].nbytes == 0
    payload = torch.zeros(0, 1024, 16)
    frame = codec.encode(m.Echo(payload), 1)
    assert codec.decode_header(frame.header, LIMITS).message.payload.shape == (0, 1024, 16)


def test_a_cached_spec_is_checked_against_each_receivers_cap():
    data = _header(_echo_spec([0, 1 << 20]))
    codec.decode_header(data, codec.FrameLimits(max_buffer_bytes=1 << 30))  # kept in the cache
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(data, codec.FrameLimits(max_buffer_bytes=1 << 10))
    assert info.value.code == m.ErrorCode.BUFFER_TOO_LARGE


@pytest.mark.parametrize("version", [True, 1.0, "1", None])
def test_a_type_version_must_be_the_int_itself(version):
    body = {"t": "ack", "v": version, "id": 1, "re": None, "f": {}, "x": {}, "b": []}
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(_header(body), LIMITS)
    assert info.value.code == m.ErrorCode.UNSUPPORTED_VERSION


@pytest.mark.parametrize("flags", [0x2, 0x8000, 0xffff])
def test_unknown_flag_bits_are_refused(flags):
    body = {"t": "ack", "v": 1, "id": 1, "re": None, "f": {}, "x": {}, "b": []}
    assert codec.decode_header(_header(body, flags=0), LIMITS).wants_reply is False
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(_header(body, flags=flags), LIMITS)
    assert info.value.code == m.ErrorCode.INVALID_FIELDS


def test_request_id_of_a_refused_header():
    body = {"t": "ack", "v": 2, "id": 42, "re": None, "f": {}, "x": {}, "b": []}
    assert codec.request_id_of(_header(body)) == 42
    assert codec.request_id_of(_header({**body, "re": 3})) is None  # a reply answers nothing
    assert codec.request_id_of(b"ILLM" + b"\xff" * 12) is None


# --- the messages' own checks ----------------------------------------------------------------


Q = torch.zeros(1, 1, 1)
INVALID = {
    "TryMoveKV negative ids": lambda: m.TryMoveKV(epoch=-1, move_id=1, req_id=1, home_inst_id=1, src_inst_id=1,
                                                  num_blocks=1, block_nbytes=1),
    "TryMoveKV negative move_id": lambda: m.TryMoveKV(0, -5, 1, 1, 1, 1, 1),
    "HoldKV negative req_id": lambda: m.HoldKV(home_inst_id=1, req_id=-1, num_blocks=2),
    "MoveReserved negative expiry": lambda: m.MoveReserved(1, 1, (1, 2), expires_in_ms=-1000),
    "MoveReserved negative block id": lambda: m.MoveReserved(1, 1, (1, -5), expires_in_ms=1),
    "MoveReserved duplicate block ids": lambda: m.MoveReserved(1, 1, (5, 5), expires_in_ms=1),
    "MoveReserved negative reservation": lambda: m.MoveReserved(1, -1, (1,), expires_in_ms=1),
    "MoveRejected negative free blocks": lambda: m.MoveRejected(1, m.MoveRejectReason.NO_SPACE, -7),
    "KVHoldReply negative": lambda: m.KVHoldReply(num_blocks_held=-1, num_blocks_free=0),
    "KVBlocksStored negative": lambda: m.KVBlocksStored(move_id=1, reservation_id=1, num_blocks=-4),
    "KVBlocks negative reservation": lambda: m.KVBlocks(1, -1, (m.BlockRun(0, 1),), (torch.zeros(1, 4),)),
    "KVBlocks run to a negative block": lambda: m.KVBlocks(1, 1, (m.BlockRun(-3, 1),), (torch.zeros(1, 4),)),
    "MoveCommit negative segment": lambda: m.MoveCommit(1, 1, req_id=1, home_inst_id=1, segment_id=-1),
    "FreeSegment negative": lambda: m.FreeSegment(home_inst_id=1, req_id=1, segment_id=1, reservation_id=-1),
    "ForwardSegment duplicate block ids": lambda: m.ForwardSegment(1, 1, 1, 1, 0, 2, "10.0.0.2", 7000, 1, (3, 3)),
    "ForwardSegment negative block id": lambda: m.ForwardSegment(1, 1, 1, 1, 0, 2, "10.0.0.2", 7000, 1, (-1,)),
    "ForwardSegment no host": lambda: m.ForwardSegment(1, 1, 1, 1, 0, 2, "", 7000, 1, (3,)),
    "ForwardSegment negative req_id": lambda: m.ForwardSegment(1, 1, 1, -1, 0, 2, "h", 7000, 1, (3,)),
    "MoveKV negative epoch": lambda: m.MoveKV(-1, 1, 1, 1, 1, 2, 1),
    "Drain negative": lambda: m.Drain(epoch=1, drain_id=-1, inst_id=1),
    "Uncordon negative": lambda: m.Uncordon(epoch=-1, drain_id=1, inst_id=1),
    "PoolFigures negative": lambda: m.PoolFigures(10, -2, 0, 0),
    "RequestPlacementEntry negative req_id": lambda: m.RequestPlacementEntry(-1, 1, 5, True),
    "PlacementKey negative": lambda: m.PlacementKey(-1, 1),
    "CreditorHint negative": lambda: m.CreditorHint(1, -100),
    "HeldSegmentRef negative": lambda: m.HeldSegmentRef(1, -1, 1),
    "Heartbeat negative seq": lambda: m.Heartbeat(inst_id=1, seq=-1, pool=m.PoolFigures(1, 1, 0, 0), batch_size=0,
                                                  placement_base_version=0, placement_version=1,
                                                  placement_upserts=(), placement_removals=()),
    "HeartbeatReply negative epoch": lambda: m.HeartbeatReply(-1, 0, False, ()),
    "AuditHeld negative creditor": lambda: m.AuditHeld(-1, ()),
    "AttendRequest negative layer": lambda: m.AttendRequest(1, 2, 0, -1, (m.AttendSlice(1, 0, 1, 0, 2),), Q),
    "AttendRequest negative segment": lambda: m.AttendRequest(1, 2, 0, 0, (m.AttendSlice(1, 0, 1, -3, 2),), Q),
    "AttendRequest negative req_id": lambda: m.AttendRequest(1, 2, 0, 0, (m.AttendSlice(-1, 0, 1, 0, 2),), Q),
    "AttendResult negative step": lambda: m.AttendResult(1, 2, -1, 0, Q, torch.zeros(1, 1)),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_messages_refuse_values_out_of_range(case):
    with pytest.raises(ValueError):
        INVALID[case]()


def test_the_sentinels_and_zeros_in_use_still_pass():
    m.TryMoveKV(epoch=0, move_id=0, req_id=0, home_inst_id=0, src_inst_id=0, num_blocks=1, block_nbytes=1)
    m.KVBlocks(0, 0, (m.BlockRun(0, 1),), (torch.zeros(1, 4),))  # commit_segment_id, home, req: -1
    m.HoldKV(home_inst_id=0, req_id=0, num_blocks=0)
    m.MoveReserved(0, 0, (), expires_in_ms=0)
    m.AttendRequest(0, 1, 0, 0, (m.AttendSlice(0, 0, 1, 0, 0),), Q)
    m.AttendResult(0, 1, 0, 0, Q, torch.zeros(1, 1))


def test_a_peer_sending_negative_values_is_refused_on_decode():
    body = {"t": "move_reserved", "v": 1, "id": 1, "re": None,
            "f": {"move_id": 1, "reservation_id": 1, "dst_block_ids": [4, 4], "expires_in_ms": 10}, "x": {}, "b": []}
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(_header(body), LIMITS)
    assert info.value.code == m.ErrorCode.INVALID_FIELDS
    hint = {"t": "heartbeat_reply", "v": 1, "id": 1, "re": None,
            "f": {"epoch": 1, "acked_placement_version": 1, "needs_full_placement": False,
                  "creditors": [[1, -100]]}, "x": {}, "b": []}
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(_header(hint), LIMITS)
    assert info.value.code == m.ErrorCode.INVALID_FIELDS


# --- shared-memory regions: removed when their owner exits without closing --------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, check=True)


def test_a_region_is_removed_when_its_owner_exits_without_closing_it(directory):
    done = _python(f"""
        import os, sys
        from infinite_llm.transport.shared_memory import SharedRegion
        region = SharedRegion({directory!r}, max_bytes=1 << 20)
        region.allocate(4096)
        if os.fork() == 0:
            sys.exit(0)  # a forked child's exit leaves its parent's file alone
        os.wait()
        print(os.path.exists(region.path), flush=True)
        """)  # then returns, with no close()
    assert done.stdout.split() == ["True"]
    assert os.listdir(directory) == []


def test_a_region_that_is_collected_unclosed_removes_its_file(directory):
    region = SharedRegion(directory, max_bytes=1 << 20)
    path = region.path
    assert os.path.exists(path)
    del region
    gc.collect()
    assert not os.path.exists(path)


def test_close_then_exit_removes_once(directory):
    region = SharedRegion(directory, max_bytes=1 << 20)
    region.close()
    region.close()
    assert os.listdir(directory) == []
    del region
    gc.collect()


def test_timeouts_still_fire_on_the_fake_clock():
    """The request path still registers its timer (encoding moved before it)."""
    async def scenario():
        clock = FakeClock()
        net = InMemoryNetwork(clock)
        a, b = net.transport(A), net.transport(B)
        await a.start(ignore)
        await b.start(lambda request: asyncio.Event().wait())
        request = asyncio.ensure_future(a.request(B, m.Ack(), timeout_s=1.0))
        await spin()
        clock.tick(1.0)
        with pytest.raises(RequestTimeout):
            await request
        net.kill(B)
        await net.settle()
    run(scenario())
