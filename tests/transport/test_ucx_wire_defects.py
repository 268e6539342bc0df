"""The UCX transport's wire against frames that break it, on loopback (UCX_TLS=tcp,sm,self):
buffers on a tag of their frame's own (a frame whose buffers never come is refused and eats
nothing behind it), refusals that answer the refused request, replies the requester refuses,
``request_soon`` whose awaitable never runs, and the draining of refused frames.

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import time

import numpy as np
import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.codec import FrameLimits
from infinite_llm.transport.errors import PeerUnreachable, PlacementRefused, RemoteError, RequestTimeout
from infinite_llm.transport.interface import PeerAddress

from conftest import run_bounded

ucxx = pytest.importorskip("ucxx")
from infinite_llm.transport import ucx  # noqa: E402  (after the skip)
from ucx_testlib import started  # noqa: E402


def kv_blocks_without_buffers(msg_id: int) -> bytes:
    """The header of a KVBlocks whose two 16 KiB runs go as UCX messages of their own."""
    data = torch.ones(2, 16384, dtype=torch.uint8)
    frame = codec.encode(m.KVBlocks(1, 1, (m.BlockRun(0, 1), m.BlockRun(1, 1)), (data[0:1], data[1:2])), msg_id)
    assert len(frame.buffers) == 2
    return frame.header


async def read_header(endpoint, timeout_s: float) -> codec.FrameHeader:
    buffer = np.zeros(1 << 16, np.uint8)
    await asyncio.wait_for(endpoint.recv(buffer), timeout_s)
    return codec.decode_header(buffer[:codec.frame_length(buffer[:codec.PREAMBLE.size])].tobytes(), FrameLimits())


def test_buffer_tags_are_the_frames_own_and_never_a_headers():
    tag = 0x8123_4567_89AB_CDEF
    tags = {ucx.buffer_tag(tag, i, r) for i in range(1, 200) for r in (False, True)}
    assert len(tags) == 398 and tag not in tags
    assert all(0 <= t < 1 << 64 and (t >> 63) != (tag >> 63) for t in tags)
    huge = ucx.buffer_tag(tag, (1 << 63) - 1, True)  # the largest id the codec lets through
    assert 0 <= huge < 1 << 64 and huge != tag


def test_a_request_whose_buffers_never_come_is_refused_and_the_requests_behind_it_are_served(ucx_loop):
    """A header that announces buffers which never follow: the requests after it on the same
    connection are answered at once (their headers are not taken for its buffers), and the
    frame itself is refused, answering its id, once the frame timeout passes."""
    handled: list[m.Message] = []

    def handler(message: m.Message) -> m.Message | None:
        handled.append(message)
        return None

    async def scenario():
        async with started(handler, frame_timeout_s=1.0, shared_memory_bytes=0) as server:
            endpoint = await ucxx.create_endpoint("127.0.0.1", server.address.port)
            try:
                await endpoint.send(np.frombuffer(kv_blocks_without_buffers(1), np.uint8))
                for msg_id in (2, 3, 4):
                    header = codec.encode(m.Drain(epoch=1, drain_id=msg_id, inst_id=1), msg_id).header
                    await endpoint.send(np.frombuffer(header, np.uint8))
                replies = [await read_header(endpoint, 2.0) for _ in range(3)]
                assert [(type(r.message), r.reply_to) for r in replies] == [(m.Ack, 2), (m.Ack, 3), (m.Ack, 4)]
                assert [type(x) for x in handled] == [m.Drain] * 3
                started_at = time.monotonic()
                refusal = await read_header(endpoint, 5.0)
                assert 0.3 < time.monotonic() - started_at < 3.0
                assert isinstance(refusal.message, m.ErrorReply) and refusal.reply_to == 1
                assert refusal.message.code == m.ErrorCode.TRUNCATED_FRAME
                assert [type(x) for x in handled] == [m.Drain] * 3  # the KVBlocks never handed on
            finally:
                endpoint.abort()
            # The listener serves on (a new connection).
            async with started(lambda message: None) as client:
                assert await client.request(server.address, m.Ack(), timeout_s=5) == m.Ack()
    run_bounded(ucx_loop, scenario(), 30)


def test_a_reply_whose_buffers_never_come_fails_at_the_frame_timeout_and_eats_no_other_reply(ucx_loop):
    """A peer answers one request with a header whose buffer never follows, and another with a
    plain reply: the plain one is delivered, and the first request fails with PeerUnreachable
    at the requester's frame timeout (not at its own timeout, nor by eating the other reply)."""
    async def serve(endpoint) -> None:
        try:
            for answer_with_missing_buffer in (True, False):
                request = await read_header(endpoint, 5.0)
                if answer_with_missing_buffer:
                    payload = torch.ones(16384, dtype=torch.uint8)
                    frame = codec.encode(m.EchoReply(payload), 100, reply_to=request.msg_id, wants_reply=False)
                    assert len(frame.buffers) == 1
                else:
                    frame = codec.encode(m.Ack(), 101, reply_to=request.msg_id, wants_reply=False)
                await endpoint.send(np.frombuffer(frame.header, np.uint8))  # the header alone
            await read_header(endpoint, 5.0)  # until the requester closes the connection
        except Exception:  # noqa: BLE001  (it does)
            pass

    async def scenario():
        listener = ucxx.create_listener(serve)
        peer = PeerAddress("127.0.0.1", listener.port)
        try:
            async with started(lambda message: None, frame_timeout_s=1.0, shared_memory_bytes=0) as client:
                first = asyncio.ensure_future(client.request(peer, m.Echo(torch.ones(4)), timeout_s=8))
                await asyncio.sleep(0.1)
                assert await client.request(peer, m.Ack(), timeout_s=3) == m.Ack()
                started_at = time.monotonic()
                with pytest.raises(PeerUnreachable):
                    await first
                assert time.monotonic() - started_at < 3.0
        finally:
            listener.close()
    run_bounded(ucx_loop, scenario(), 30)


def test_request_soon_whose_awaitable_never_runs_leaves_nothing_pending(ucx_loop):
    """A caller that wraps ``request_soon`` in a task and cancels it before it starts: the
    request's pending entry goes at its timeout, and the connection can idle."""
    async def never(message: m.Message) -> m.Message | None:
        await asyncio.sleep(3600)

    async def finish(reply):
        return await reply

    async def scenario():
        async with started(never) as server, started(lambda message: None) as client:
            await client.connect(server.address)
            connection = client._outbound[server.address]
            reply = client.request_soon(server.address, m.Drain(epoch=1, drain_id=1, inst_id=2), timeout_s=0.5)
            task = asyncio.ensure_future(finish(reply))
            task.cancel()
            await asyncio.sleep(0)
            assert task.cancelled()
            reply.close()  # never awaited, and said so
            assert connection.pending
            await asyncio.sleep(1.0)
            assert not connection.pending and not connection.busy()
            # A request_soon that is awaited times out as before.
            with pytest.raises(RequestTimeout):
                await client.request_soon(server.address, m.Drain(epoch=1, drain_id=2, inst_id=2), timeout_s=0.3)
            assert not connection.pending
    run_bounded(ucx_loop, scenario(), 30)


def test_request_soon_with_no_connection_whose_awaitable_never_runs_leaves_no_unread_failure(ucx_loop):
    """``request_soon`` to a peer with no open connection runs ``request`` as a task of the
    transport's. A caller that never runs the awaitable (its task cancelled before its first
    step) leaves no failure unread when the peer turns out gone, and close ends no such task
    late."""
    contexts: list[dict] = []

    async def finish(reply):
        return await reply

    async def scenario():
        async with started(lambda message: None) as gone:
            dead = gone.address  # nothing listens there any more
        loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(lambda _loop, context: contexts.append(context))
        try:
            async with started(lambda message: None, connect_timeout_s=0.3) as client:
                reply = client.request_soon(dead, m.Ack(), timeout_s=1.0)
                task = asyncio.ensure_future(finish(reply))
                task.cancel()  # before its first step: the awaitable is never run
                await asyncio.sleep(0)
                assert task.cancelled()
                del reply, task
                await asyncio.sleep(1.5)  # past the connect timeout and the request's own
                gc.collect()
                await asyncio.sleep(0)
                assert not client._tasks
                # Awaited, it raises as request does.
                with pytest.raises(PeerUnreachable):
                    await client.request_soon(dead, m.Ack(), timeout_s=1.0)
        finally:
            loop.set_exception_handler(previous)
    run_bounded(ucx_loop, scenario(), 30)
    unread = [c for c in contexts if "never retrieved" in str(c.get("message"))]
    assert not unread, [(c.get("message"), repr(c.get("exception"))) for c in unread]


SMALL = dict(limits=FrameLimits(max_buffer_bytes=1024, max_total_buffer_bytes=1024))


async def slow_drain(message: m.Message) -> m.Message | None:
    if isinstance(message, m.Drain):
        await asyncio.sleep(message.drain_id / 1000)
    return None


@pytest.mark.parametrize("refused", [
    pytest.param(m.Echo(torch.zeros(4096, dtype=torch.uint8)), id="buffer-over-the-cap"),
    pytest.param(m.Drain(epoch=True, drain_id=1, inst_id=2), id="bool-in-an-int-field"),
])
def test_a_refused_request_gets_remote_error_and_the_others_on_its_connection_peer_unreachable(ucx_loop, refused):
    async def scenario():
        async with started(slow_drain, **SMALL) as server, started(lambda message: None) as client:
            await client.connect(server.address)
            other = asyncio.ensure_future(client.request(server.address, m.Drain(epoch=1, drain_id=500, inst_id=2)))
            await asyncio.sleep(0.05)
            with pytest.raises(RemoteError) as info:
                await client.request(server.address, refused, timeout_s=5)
            assert info.value.code in (m.ErrorCode.BUFFER_TOO_LARGE, m.ErrorCode.INVALID_FIELDS)
            with pytest.raises(PeerUnreachable):
                await other
            assert server.address not in client._outbound  # dropped: the next request connects afresh
            assert await client.request(server.address, m.Ack(), timeout_s=5) == m.Ack()
    run_bounded(ucx_loop, scenario(), 30)


def test_a_reply_refused_by_the_requester_is_peer_unreachable(ucx_loop):
    """A reply over the requester's header limit: its request, and the others on the
    connection, fail with PeerUnreachable (an interface error), not ProtocolError."""
    big = m.MoveReserved(move_id=1, reservation_id=1, dst_block_ids=tuple(range(100000, 120000)), expires_in_ms=5000)

    async def handler(message: m.Message) -> m.Message | None:
        if isinstance(message, m.TryMoveKV):
            return big
        return await slow_drain(message)

    async def scenario():
        limits = FrameLimits(max_header_bytes=64 << 10)
        async with started(handler) as server, started(lambda message: None, limits=limits) as client:
            await client.connect(server.address)
            other = asyncio.ensure_future(client.request(server.address, m.Drain(epoch=1, drain_id=300, inst_id=2)))
            await asyncio.sleep(0.05)
            with pytest.raises(PeerUnreachable):
                await client.request(server.address, m.TryMoveKV(0, 1, 1, 1, 1, 20000, 4096), timeout_s=5)
            with pytest.raises(PeerUnreachable):
                await other
            assert await client.request(server.address, m.Ack(), timeout_s=5) == m.Ack()
    run_bounded(ucx_loop, scenario(), 30)


@pytest.mark.parametrize("shared_memory_bytes", [0, 1 << 28], ids=["over-ucx", "shared-memory"])
def test_a_refused_frame_is_drained_into_host_scratch_not_fresh_destinations(ucx_loop, monkeypatch, shared_memory_bytes):
    """A KVBlocks whose placement is refused: nothing is allocated on the receiving device for
    it (its buffers over UCX are drained into host scratch, those in shared memory not at all),
    the sender hears why, and the connection serves on."""
    allocations: list[tuple[int, str]] = []
    real_allocate = ucx.allocate

    def recording_allocate(spec, device):
        allocations.append((spec.nbytes, device))
        return real_allocate(spec, device)
    monkeypatch.setattr(ucx, "allocate", recording_allocate)

    def refuse(message: m.Message):
        if isinstance(message, m.KVBlocks):
            raise PlacementRefused("no reservation (expired)")
        return None

    async def scenario():
        config = dict(shared_memory_bytes=shared_memory_bytes)
        async with started(lambda message: None, refuse, **config) as server, \
                started(lambda message: None, **config) as client:
            data = torch.ones(4, 1 << 20, dtype=torch.uint8)
            for _ in range(2):
                with pytest.raises(RemoteError) as info:
                    await client.request(server.address, m.KVBlocks(
                        move_id=1, reservation_id=9, runs=(m.BlockRun(0, 2), m.BlockRun(4, 2)),
                        runs_data=(data[:2], data[2:]), home_inst_id=1, req_id=1), timeout_s=10)
                assert info.value.code == m.ErrorCode.PLACEMENT_REFUSED
            assert client.uses_shared_memory(server.address) == (shared_memory_bytes > 0)
            assert await client.request(server.address, m.Ack(), timeout_s=5) == m.Ack()
    run_bounded(ucx_loop, scenario(), 30)
    assert allocations == []


def test_a_header_cut_short_over_ucx_is_refused_not_read_out_of_stale_bytes(ucx_loop):
    """UCX receives a header into a buffer of the largest size allowed and does not say how
    many bytes came. An Echo announcing 100 inline bytes, sent without them, after a Drain whose
    UCX message ran 400 bytes past its announced length: the buffer holds those bytes where the
    inline ones should be. The header's end mark is missing there, so the frame is refused as
    truncated and the handler never sees it."""
    echoed: list[bytes] = []

    def handler(message: m.Message):
        if isinstance(message, m.Echo):
            echoed.append(bytes(message.payload.numpy()))
            return m.EchoReply(message.payload)
        return None

    async def scenario():
        async with started(handler, shared_memory_bytes=0, header_ring_bytes=0) as server:
            endpoint = await ucxx.create_endpoint("127.0.0.1", server.address.port)
            try:
                drain = codec.encode(m.Drain(epoch=1, drain_id=1, inst_id=1), 1).header
                await endpoint.send(np.frombuffer(drain + b"X" * 400, np.uint8))
                first = await read_header(endpoint, 5.0)
                assert first.reply_to == 1
                echo = codec.encode(m.Echo(torch.full((100,), 7, dtype=torch.uint8)), 2).header
                await endpoint.send(np.frombuffer(echo[:-100], np.uint8))
                return await read_header(endpoint, 5.0)
            finally:
                endpoint.abort()

    reply = run_bounded(ucx_loop, scenario(), 30)
    assert echoed == []
    assert isinstance(reply.message, m.ErrorReply) and reply.message.code == m.ErrorCode.TRUNCATED_FRAME
    assert reply.reply_to == 2
