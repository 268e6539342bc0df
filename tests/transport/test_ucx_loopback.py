"""The UCX transport on loopback (UCX_TLS=tcp,sm,self) against real peer processes; host buffers
of requests go through the sender's shared-memory region unless a test turns it off.

Peers are separate processes, killed for real with SIGKILL. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import PeerUnreachable, ProtocolError, RemoteError, RequestTimeout, TransportError
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.shared_memory import SharedRegion

from conftest import run_bounded
from test_codec_fuzz import STRATEGIES

ucxx = pytest.importorskip("ucxx")
from infinite_llm.transport import ucx  # noqa: E402  (after the skip)
from infinite_llm.transport.ucx import UcxTransport  # noqa: E402
from ucx_testlib import started  # noqa: E402
from hostile_frames import peer_refuses, send_raw_and_read_refusal  # noqa: E402

STARTUP_TIMEOUT_S = 30.0


class Peer:
    """A peer process running ucx_peer.py."""

    def __init__(self, command: list[str], *args: str) -> None:
        self.process = subprocess.Popen([*command, *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        self.first_line = self._read_ready_line(STARTUP_TIMEOUT_S)

    def _read_ready_line(self, timeout_s: float) -> str:
        """The peer's "PORT n" or "FLOODING" line; UCX may log to stdout before it."""
        deadline = time.monotonic() + timeout_s
        seen: list[str] = []
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select([self.process.stdout], [], [], remaining)
            if not ready:
                break
            line = self.process.stdout.readline()
            if not line:  # the peer exited
                break
            if line.startswith(("PORT ", "FLOODING")):
                return line.strip()
            seen.append(line.strip())
        self.kill()
        raise RuntimeError(f"peer process did not start: {seen[-5:]}")

    @property
    def address(self) -> PeerAddress:
        return PeerAddress("127.0.0.1", int(self.first_line.split()[1]))

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)


@pytest.fixture
def start_peer(peer_command) -> Iterator:
    peers: list[Peer] = []

    def start(*args: str) -> Peer:
        peers.append(Peer(peer_command, *args))
        return peers[-1]

    yield start
    for peer in peers:
        peer.kill()


async def serve_echo(message: m.Message) -> m.Message | None:
    return m.EchoReply(message.payload) if isinstance(message, m.Echo) else None


@pytest.fixture
def client(ucx_loop) -> Iterator[UcxTransport]:
    transport = UcxTransport(TransportConfig(request_timeout_s=10))
    run_bounded(ucx_loop, transport.start(serve_echo), 10)
    yield transport
    run_bounded(ucx_loop, transport.close(), 20)


def filled_blocks(first_block: int, num_blocks: int) -> torch.Tensor:
    """Blocks whose every value is (block id + 1), as the peer checks."""
    values = torch.arange(first_block + 1, first_block + num_blocks + 1, dtype=torch.float32)
    return values.reshape(-1, 1, 1, 1, 1, 1).expand(num_blocks, 2, 2, 16, 2, 8).contiguous()


def test_request_response(ucx_loop, start_peer, client):
    peer = start_peer("serve")

    async def scenario():
        small = await client.request(peer.address, m.Echo(torch.arange(5)))
        assert torch.equal(small.payload, torch.arange(5))
        large_payload = torch.randn(3 << 20)  # 12 MiB, not inline
        large = await client.request(peer.address, m.Echo(large_payload))
        assert torch.equal(large.payload, large_payload)
        runs = (m.BlockRun(3, 4), m.BlockRun(10, 1), m.BlockRun(20, 8))
        stored = await client.request(peer.address, m.KVBlocks(
            move_id=1, reservation_id=7, runs=runs,
            runs_data=tuple(filled_blocks(r.dst_block_id, r.num_blocks) for r in runs)))
        assert stored == m.KVBlocksStored(1, 7, 13)
        with pytest.raises(RemoteError) as info:
            await client.request(peer.address, m.KVBlocks(1, 8, runs[:1], (filled_blocks(3, 4),)))
        assert info.value.code == m.ErrorCode.PLACEMENT_REFUSED
        assert await client.request(peer.address, m.Drain(1, 1, 1)) == m.Ack()  # same connection
    run_bounded(ucx_loop, scenario(), 30)


def test_idle_connection_costs_no_cpu(ucx_loop, start_peer, client):
    """With a connection open (a header receive posted on it), the process sleeps while no
    message moves. A busy-looping wait here is what made two processes sharing a core take
    turns, one scheduler time slice (4-12 ms) per frame."""
    peer = start_peer("serve")

    async def scenario():
        await client.request(peer.address, m.Echo(torch.arange(5)))
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        assert cpu_share < 0.2, f"idle transport used {cpu_share:.0%} of a core"
        reply = await client.request(peer.address, m.Echo(torch.arange(7)))  # still works
        assert torch.equal(reply.payload, torch.arange(7))
    run_bounded(ucx_loop, scenario(), 30)


def test_a_process_whose_connections_closed_costs_no_cpu(ucx_loop):
    """Once its last connection is gone, nothing waits on UCX: the process must not spin on
    the worker's fd (which stays readable after an event until the worker is armed). Both
    ends in this process: closing one end is an event for the other."""

    async def scenario():
        server = UcxTransport(TransportConfig(request_timeout_s=10))
        await server.start(lambda message: m.EchoReply(message.payload) if isinstance(message, m.Echo) else None)
        client = UcxTransport(TransportConfig(request_timeout_s=10))
        await client.start(lambda message: None)
        reply = await client.request(server.address, m.Echo(torch.arange(5)))
        assert torch.equal(reply.payload, torch.arange(5))
        await client.close()
        await asyncio.sleep(0.2)  # the server sees its connection end
        cpu0, wall0 = time.process_time(), time.monotonic()
        await asyncio.sleep(0.5)
        cpu_share = (time.process_time() - cpu0) / (time.monotonic() - wall0)
        await server.close()
        assert cpu_share < 0.2, f"a process with no connection used {cpu_share:.0%} of a core"
    run_bounded(ucx_loop, scenario(), 30)


def test_many_in_flight(ucx_loop, start_peer, client):
    peer = start_peer("serve")

    async def scenario():
        sizes = [16, 5000, 70_000, 1 << 20]
        payloads = [torch.full((sizes[i % 4],), i % 251, dtype=torch.uint8) for i in range(400)]
        slow = asyncio.gather(*(client.request(peer.address, m.Drain(1, 200, 1))
                                for _ in range(5)))  # slow handlers do not hold up the rest
        replies = await asyncio.gather(*(client.request(peer.address, m.Echo(p))
                                         for p in payloads))
        for payload, reply in zip(payloads, replies):
            assert torch.equal(reply.payload, payload)
        assert await slow == [m.Ack()] * 5
    run_bounded(ucx_loop, scenario(), 60)


def test_peer_killed_mid_transfer(ucx_loop, start_peer, client):
    """The request to the killed peer fails in under 2 s; another peer is served throughout."""
    doomed, survivor = start_peer("serve"), start_peer("serve")

    async def scenario():
        big = torch.ones(64 << 20, dtype=torch.uint8)
        await client.request(doomed.address, m.Ack())  # connected: the kill lands mid-transfer
        in_flight = [asyncio.ensure_future(client.request(doomed.address, m.Echo(big),
                                                          timeout_s=30)) for _ in range(3)]
        await asyncio.sleep(0.02)
        killed_at = time.monotonic()
        doomed.kill()
        other = asyncio.ensure_future(client.request(survivor.address, m.Echo(torch.arange(9))))
        # The peer echoes the three in turn: the first may be back before the kill, whole; the
        # one the kill lands in, and those behind it, fail.
        outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, Exception)]
        assert failed and all(isinstance(o, PeerUnreachable) for o in failed), outcomes
        assert all(torch.equal(o.payload, big) for o in outcomes if not isinstance(o, Exception))
        noticed_s = time.monotonic() - killed_at
        assert noticed_s < 2.0
        assert torch.equal((await other).payload, torch.arange(9))
        with pytest.raises(PeerUnreachable):
            await client.request(doomed.address, m.Ack(), timeout_s=5)
        assert await client.request(survivor.address, m.Drain(1, 1, 1)) == m.Ack()
        return noticed_s
    print(f"noticed in {run_bounded(ucx_loop, scenario(), 60):.3f} s")


def test_client_killed_mid_transfer_leaves_the_listener_serving(ucx_loop, start_peer, client):
    flooder = start_peer("flood", client.address.host, str(client.address.port))

    async def scenario():
        await asyncio.sleep(0.5)  # a few 16 MiB requests are in flight by now
        flooder.kill()
        for _ in range(3):
            reply = await client.request(client.address, m.Echo(torch.arange(3)))
            assert torch.equal(reply.payload, torch.arange(3))
    run_bounded(ucx_loop, scenario(), 30)


def test_listeners_whose_clients_were_killed_mid_transfer_are_still_reached(ucx_loop, start_peer):
    """Four times: a fresh transport listens, a flooder is killed while its 16 MiB requests to it
    are in flight, and the transport's own request to its listener is answered: one process's
    UCX worker outlives its peers' deaths (see docs/transport.md on shared memory)."""
    async def scenario():
        for _ in range(4):
            async with started(serve_echo) as transport:
                flooder = start_peer("flood", transport.address.host, str(transport.address.port))
                await asyncio.sleep(0.5)
                flooder.kill()
                reply = await transport.request(transport.address, m.Echo(torch.arange(3)))
                assert torch.equal(reply.payload, torch.arange(3))
    run_bounded(ucx_loop, scenario(), 90)


def test_listener_restart_is_reached_again(ucx_loop, start_peer, client):
    first = start_peer("serve")
    address = first.address

    async def scenario():
        assert await client.request(address, m.Drain(1, 1, 1)) == m.Ack()
        first.kill()
        await asyncio.sleep(0.2)  # the cached connection sees the reset
        # The old listener's port may linger in the kernel a moment; retry the start, as a
        # supervisor restarting the daemon would.
        deadline = time.monotonic() + 15
        while True:
            try:
                restarted = start_peer("serve", str(address.port))
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        assert restarted.address == address
        deadline = time.monotonic() + 10
        while True:  # the first attempt may still meet the dead connection
            try:
                return await client.request(address, m.Echo(torch.arange(4)), timeout_s=5)
            except TransportError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
    reply = run_bounded(ucx_loop, scenario(), 30)
    assert torch.equal(reply.payload, torch.arange(4))


# --- a live listener refuses malformed frames with ErrorReply and closes the connection ---


def test_live_listener_refuses_an_oversized_frame(ucx_loop, start_peer, client):
    peer = start_peer("serve")
    reply = run_bounded(ucx_loop, send_raw_and_read_refusal(peer.address, bytes(2 << 20)), 20)
    assert reply.code == m.ErrorCode.OVERSIZED_FRAME
    assert run_bounded(ucx_loop, client.request(peer.address, m.Ack()), 10) == m.Ack()


def live_fuzz(ucx_loop, peer: Peer, client: UcxTransport, examples: int) -> None:
    frames = st.one_of(*STRATEGIES.values()).filter(peer_refuses)

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(frames)
    def refused(data: bytes) -> None:
        reply = run_bounded(ucx_loop, send_raw_and_read_refusal(peer.address, data), 20)
        assert isinstance(reply, m.ErrorReply)

    refused()
    # The listener still serves well-formed requests.
    assert run_bounded(ucx_loop, client.request(peer.address, m.Ack()), 10) == m.Ack()
    assert peer.process.poll() is None


def test_live_listener_fuzz(ucx_loop, start_peer, client):
    live_fuzz(ucx_loop, start_peer("serve"), client, examples=300)


@pytest.mark.slow
def test_live_listener_fuzz_long(ucx_loop, start_peer, client):
    live_fuzz(ucx_loop, start_peer("serve"), client, examples=5_000)


def test_request_soon_leaves_before_the_caller_computes(ucx_loop, start_peer, client):
    """The frame of ``request_soon`` is posted before it returns (on an open connection): the
    peer's work overlaps the caller's blocking computation instead of following it."""
    peer = start_peer("serve")
    handler_s = compute_s = 0.3  # the peer's Drain handler sleeps drain_id ms

    async def scenario():
        first = client.request_soon(peer.address, m.Echo(torch.arange(3)))  # connects: a task
        assert torch.equal((await first).payload, torch.arange(3))
        started = time.monotonic()
        pending = client.request_soon(peer.address, m.Drain(1, int(handler_s * 1000), 1))
        time.sleep(compute_s)  # the caller computes without yielding to the loop
        assert await pending == m.Ack()
        elapsed = time.monotonic() - started
        assert elapsed < handler_s + compute_s - 0.1, f"no overlap: {elapsed:.3f} s"
    run_bounded(ucx_loop, scenario(), 30)


def test_request_soon_to_a_killed_peer_fails_cleanly(ucx_loop, start_peer, client):
    peer = start_peer("serve")

    async def scenario():
        await client.request(peer.address, m.Echo(torch.arange(3)))
        peer.kill()
        with pytest.raises(TransportError):
            await client.request_soon(peer.address, m.Echo(torch.arange(3)), timeout_s=5)
        with pytest.raises(TransportError):  # and again, now without a connection
            await client.request_soon(peer.address, m.Echo(torch.arange(3)), timeout_s=5)
    run_bounded(ucx_loop, scenario(), 30)


def test_connect_ahead_opens_the_connection_requests_then_use(ucx_loop, start_peer, client):
    peer = start_peer("serve")

    async def scenario():
        await client.connect(peer.address)
        connection = client._outbound[peer.address]
        await client.connect(peer.address)  # already open: nothing new
        assert client._outbound[peer.address] is connection
        reply = await client.request(peer.address, m.Echo(torch.arange(4)))
        assert torch.equal(reply.payload, torch.arange(4)) and client._outbound[peer.address] is connection
        peer.kill()
        started = time.monotonic()
        with pytest.raises(PeerUnreachable):
            for _ in range(50):  # the dead connection is noticed, then the new attempt fails
                await client.connect(peer.address)
                await asyncio.sleep(0.05)
        assert time.monotonic() - started < 5
    run_bounded(ucx_loop, scenario(), 30)



def test_host_buffers_to_a_local_peer_go_through_shared_memory(ucx_loop, start_peer, client):
    """A peer process on this host maps the client's region: a request's large host buffers go
    through it (copied in, or as they lie where they are in it already), land whole, and their
    slots are free again once answered."""
    peer = start_peer("serve")
    copies_in: list[int] = []

    async def scenario():
        await client.connect(peer.address)
        assert client.uses_shared_memory(peer.address)
        region = client._shared_region
        copy_in = region.copy_in
        region.copy_in = lambda array: copies_in.append(1) or copy_in(array)
        payload = torch.randn(3 << 20)
        assert torch.equal((await client.request(peer.address, m.Echo(payload))).payload, payload)
        runs = (m.BlockRun(3, 4), m.BlockRun(20, 8))
        stored = await client.request(peer.address, m.KVBlocks(
            move_id=1, reservation_id=7, runs=runs,
            runs_data=tuple(filled_blocks(r.dst_block_id, r.num_blocks) for r in runs)))
        assert stored == m.KVBlocksStored(1, 7, 12) and len(copies_in) == 3
        # A buffer in the region already is sent as it lies: no copy.
        blocks = filled_blocks(40, 8)
        staged = client.shared_host_buffer(blocks.nbytes).view(torch.float32).view(blocks.shape).copy_(blocks)
        stored = await client.request(peer.address, m.KVBlocks(2, 7, (m.BlockRun(40, 8),), (staged,)))
        assert stored == m.KVBlocksStored(2, 7, 8) and len(copies_in) == 3
        assert region.bytes_in_use == staged.nbytes  # the copies' slots are free again
        many = [client.request(peer.address, m.Echo(torch.full((1 << 18,), float(i)))) for i in range(16)]
        for i, reply in enumerate(await asyncio.gather(*many)):
            assert bool((reply.payload == i).all())
        assert region.bytes_in_use == staged.nbytes
    run_bounded(ucx_loop, scenario(), 30)


def test_slots_of_requests_to_a_killed_peer_are_freed_a_frame_timeout_later(ucx_loop, start_peer):
    """A peer killed while it copies out of the region: the requests fail at once, and their
    slots are used again only after the frame timeout (the peer might still have been reading)."""
    peer = start_peer("serve")
    frame_timeout_s = 0.5

    async def scenario():
        async with started(serve_echo, frame_timeout_s=frame_timeout_s) as sender:
            await sender.connect(peer.address)
            region = sender._shared_region
            in_flight = [asyncio.ensure_future(sender.request(peer.address, m.Echo(torch.randn(4 << 20))))
                         for _ in range(4)]
            await asyncio.sleep(0)  # all four copied in and posted
            assert region.bytes_in_use == 4 * (16 << 20)
            peer.kill()
            failed_at = time.monotonic()
            outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
            assert any(isinstance(o, PeerUnreachable) for o in outcomes), outcomes
            if time.monotonic() - failed_at < frame_timeout_s / 2:
                assert region.bytes_in_use > 0  # not yet
            await asyncio.sleep(frame_timeout_s + 0.2)
            assert region.bytes_in_use == 0
    run_bounded(ucx_loop, scenario(), 30)


def test_slots_of_a_request_its_peer_never_answers_are_used_again_after_its_time(ucx_loop, directory):
    """A live peer that answers everything but one request: that request times out and no reply
    frees its slot, which is freed a little after the request's time (its frame's ``su``), past
    which the peer reads nothing out of it; the connection serves on throughout."""
    async def handler(message: m.Message) -> m.Message | None:
        if isinstance(message, m.Echo):
            await asyncio.sleep(3600)  # never answered
        return None

    async def scenario():
        config = dict(shared_memory_dir=directory)
        async with started(handler, **config) as server, started(lambda message: None, **config) as client:
            await client.connect(server.address)
            assert client.uses_shared_memory(server.address)
            connection = client._outbound[server.address]
            for _ in range(4):
                with pytest.raises(RequestTimeout):
                    await client.request(server.address, m.Echo(torch.ones(1 << 20, dtype=torch.uint8)),
                                         timeout_s=0.2)
            with pytest.raises(RequestTimeout):  # and through request_soon
                await client.request_soon(server.address, m.Echo(torch.ones(1 << 20, dtype=torch.uint8)),
                                          timeout_s=0.2)
            assert client.shared_memory_status()["in_use_bytes"] > 0  # not yet: within the grace
            await asyncio.sleep(ucx.SHARED_SLOTS_GRACE_S + 0.3)
            assert await client.request(server.address, m.Ack(), timeout_s=2) == m.Ack()
            assert client._outbound[server.address] is connection
            return client.shared_memory_status()["in_use_bytes"]
    assert run_bounded(ucx_loop, scenario(), 30) == 0


def test_a_request_read_after_its_time_is_answered_expired_and_the_connection_serves_on(ucx_loop, directory):
    """The listener comes to a request's header after the request's time (its loop was held):
    its buffers in the sender's shared memory may be in use again, so it copies nothing, answers
    ``expired`` and serves the connection's next request."""
    echoed: list[int] = []

    def handler(message: m.Message) -> m.Message | None:
        if isinstance(message, m.Drain):
            time.sleep(message.drain_id / 1000)  # holds the listener's event loop
            return None
        if isinstance(message, m.Echo):
            echoed.append(int(message.payload[0]))
            return m.EchoReply(message.payload[:4].clone())
        return None

    async def scenario():
        config = dict(shared_memory_dir=directory)
        async with started(handler, **config) as server, started(lambda message: None, **config) as client:
            await client.connect(server.address)
            connection = client._outbound[server.address]
            # Both posted now; the listener's handler of the first holds its loop (and the
            # client's: one event loop) past the second's time.
            held = client.request_soon(server.address, m.Drain(epoch=1, drain_id=600, inst_id=1), timeout_s=5)
            late = client.request_soon(server.address, m.Echo(torch.full((1 << 20,), 7, dtype=torch.uint8)),
                                       timeout_s=0.2)
            with pytest.raises((RequestTimeout, RemoteError)) as info:
                await late
            assert info.type is RequestTimeout or info.value.code == m.ErrorCode.EXPIRED
            await held
            reply = await client.request(server.address, m.Echo(torch.full((1 << 20,), 9, dtype=torch.uint8)),
                                         timeout_s=5)
            assert client._outbound[server.address] is connection and not connection.broken
            return reply
    reply = run_bounded(ucx_loop, scenario(), 30)
    assert echoed == [9] and bool((reply.payload == 9).all())


def test_a_shared_memory_offer_on_another_clock_is_refused(ucx_loop, directory):
    """An offer whose CLOCK_MONOTONIC is ahead of the receiver's (another time namespace): the
    times in its frames would not mean the same here, so the region is not mapped."""
    async def scenario():
        async with started(serve_echo, shared_memory_dir=directory, header_ring_bytes=0) as server:
            region = SharedRegion(directory, 1 << 20)
            endpoint = await ucxx.create_endpoint("127.0.0.1", server.address.port)
            try:
                answers = []
                for msg_id, clock_ns in ((1, time.monotonic_ns() + 10_000_000_000), (2, time.monotonic_ns())):
                    offer = m.SharedMemoryOffer(region=region.name, nonce=region.nonce.hex(), clock_ns=clock_ns)
                    await endpoint.send(np.frombuffer(codec.encode(offer, msg_id).header, np.uint8))
                    buffer = np.zeros(1 << 16, np.uint8)
                    await asyncio.wait_for(endpoint.recv(buffer), 5)
                    answers.append(codec.decode_header(
                        buffer[:codec.frame_length(buffer[:codec.PREAMBLE.size])].tobytes(), codec.FrameLimits()))
                return [a.message for a in answers]
            finally:
                endpoint.abort()
                region.close()
    refused, mapped = run_bounded(ucx_loop, scenario(), 30)
    assert isinstance(refused, m.ErrorReply) and refused.code == m.ErrorCode.SHARED_MEMORY_UNAVAILABLE
    assert "not the same clock" in refused.detail
    assert mapped == m.Ack()


def test_a_buffer_lent_from_the_region_outlives_a_request_that_timed_out(ucx_loop):
    """The caller gives up on a request and drops its buffer; the buffer's slot is not used
    again until a little after the request's time, past which the peer reads nothing of it."""
    async def slow_echo(message: m.Message):
        await asyncio.sleep(0.5)
        return m.EchoReply(message.payload[:1]) if isinstance(message, m.Echo) else None

    async def scenario():
        async with started(slow_echo) as server, started(serve_echo) as sender:
            await sender.connect(server.address)
            region = sender._shared_region
            buffer = sender.shared_host_buffer(1 << 20)
            with pytest.raises(RequestTimeout):
                await sender.request(server.address, m.Echo(buffer), timeout_s=0.1)
            del buffer
            gc.collect()
            assert region.bytes_in_use == 1 << 20  # the peer may still read it
            await asyncio.sleep(ucx.SHARED_SLOTS_GRACE_S + 0.2)
            gc.collect()  # the timed-out request's traceback may hold the message in a cycle
            assert region.bytes_in_use == 0
    run_bounded(ucx_loop, scenario(), 30)


def test_a_peer_that_does_not_know_the_offer_is_reached_without_shared_memory(ucx_loop, monkeypatch):
    """A peer of an earlier version refuses the offer as an unknown type and closes the
    connection: the sender connects again without offering, and its requests go over UCX."""
    def unknown(connection, offer):
        raise ProtocolError(m.ErrorCode.UNKNOWN_TYPE, repr(offer.TYPE))

    async def scenario():
        async with started(serve_echo) as server, started(serve_echo) as sender:
            monkeypatch.setattr(server, "_accept_shared_memory", unknown)
            payload = torch.randn(1 << 18)
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)
            assert not sender.uses_shared_memory(server.address)
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)
    run_bounded(ucx_loop, scenario(), 30)


def test_a_frame_whose_connection_breaks_while_it_is_copied_out_is_not_delivered(ucx_loop, monkeypatch):
    """The sender drops the connection while the receiver copies a frame out of its shared
    memory: it may give those slots to other frames, so the frame is dropped, never handed to
    the handler."""
    from infinite_llm.transport.shared_memory import PeerRegion
    seen: list[m.Message] = []

    def keep(message: m.Message):
        seen.append(message)
        return None

    async def scenario():
        async with started(keep) as server, started(serve_echo) as sender:
            await sender.connect(server.address)
            copy_to = PeerRegion.copy_to

            def copy_then_break(region, view, offset, nbytes):
                """Copy, then the sender drops the connection, and UCX tells the receiver."""
                landed = copy_to(region, view, offset, nbytes)
                sender._outbound[server.address].abort()
                [inbound] = server._inbound
                deadline = time.monotonic() + 5
                while time.monotonic() < deadline:
                    server._progress._worker.progress()
                    try:
                        inbound._ucx_endpoint.raise_on_error()
                    except Exception:
                        break
                    time.sleep(0.001)
                return landed
            monkeypatch.setattr(PeerRegion, "copy_to", copy_then_break)
            runs = (m.BlockRun(0, 16), m.BlockRun(32, 16))  # 128 KiB each: not inline
            with pytest.raises((PeerUnreachable, RequestTimeout)):
                await sender.request(server.address, m.KVBlocks(1, 7, runs, (filled_blocks(0, 16), filled_blocks(32, 16))),
                                     timeout_s=5)
            assert seen == []
    run_bounded(ucx_loop, scenario(), 30)


def test_a_reply_that_cannot_be_read_fails_its_request_at_once(ucx_loop, monkeypatch):
    """An error while reading a reply (here: no memory for its buffer) drops the connection:
    the request fails now rather than at its timeout, and the next one connects again."""
    async def scenario():
        async with started(serve_echo) as server, started(serve_echo) as sender:
            payload = torch.randn(1 << 18)  # 1 MiB: its reply's buffer is allocated fresh
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)

            def no_memory(header):
                raise MemoryError("no room for the reply")
            monkeypatch.setattr(sender, "_fresh_destinations", no_memory)
            started_at = time.monotonic()
            with pytest.raises(PeerUnreachable):
                await sender.request(server.address, m.Echo(payload), timeout_s=8)
            assert time.monotonic() - started_at < 4
            monkeypatch.undo()
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)
    run_bounded(ucx_loop, scenario(), 30)


def test_with_shared_memory_off_on_either_side_buffers_go_over_ucx(ucx_loop, client):
    async def scenario():
        async with started(serve_echo, shared_memory_bytes=0) as server, \
                started(serve_echo, shared_memory_bytes=0) as sender:
            payload = torch.randn(1 << 20)
            for source, destination in ((client, server.address), (sender, client.address)):
                reply = await source.request(destination, m.Echo(payload))
                assert torch.equal(reply.payload, payload)
                assert not source.uses_shared_memory(destination)
    run_bounded(ucx_loop, scenario(), 30)


def test_a_frame_pointing_outside_the_shared_region_is_refused(ucx_loop, start_peer, client):
    peer = start_peer("serve")

    async def scenario():
        await client.connect(peer.address)
        connection = client._outbound[peer.address]
        connection.place_shared = lambda array: 1 << 40
        with pytest.raises(RemoteError) as info:
            await client.request(peer.address, m.Echo(torch.randn(1 << 16)))
        assert info.value.code == m.ErrorCode.LENGTH_MISMATCH
        payload = torch.randn(1 << 16)  # a new connection, served
        assert torch.equal((await client.request(peer.address, m.Echo(payload))).payload, payload)
    run_bounded(ucx_loop, scenario(), 30)
    assert peer.process.poll() is None


def test_a_frame_in_shared_memory_never_offered_is_refused(ucx_loop, start_peer):
    peer = start_peer("serve")

    async def scenario():
        async with started(serve_echo, shared_memory_bytes=0) as sender:
            await sender.connect(peer.address)
            region = SharedRegion(max_bytes=8 << 20)  # never offered to the peer
            try:
                sender._outbound[peer.address].shared_out = region
                with pytest.raises(RemoteError) as info:
                    await sender.request(peer.address, m.Echo(torch.randn(1 << 16)))
                assert info.value.code == m.ErrorCode.INVALID_FIELDS
            finally:
                region.close()
            assert await sender.request(peer.address, m.Ack()) == m.Ack()
    run_bounded(ucx_loop, scenario(), 30)


@pytest.mark.gpu
def test_inline_frames_land_on_the_host_others_on_the_device(ucx_loop, start_peer):
    """With ``land_inline_on_host``, a GPU receiver lands a frame whose buffers all came inside
    its header in host memory (for the reader to move on a stream of its choice); a frame with
    a separate buffer lands on its device."""
    peer = start_peer("serve")
    transport = UcxTransport(TransportConfig(request_timeout_s=10, receive_device="cuda", land_inline_on_host=True))

    async def scenario():
        await transport.start(lambda message: None)
        try:
            small = torch.randn(256)  # 1 KiB: inline
            return await transport.request(peer.address, m.Echo(small)), small
        finally:
            await transport.close()
    reply, small = run_bounded(ucx_loop, scenario(), 30)
    assert not reply.payload.is_cuda and torch.equal(reply.payload, small)
    frame = codec.encode(m.Echo(torch.randn(1 << 16)), msg_id=1)  # 256 KiB: a separate buffer
    header = codec.decode_header(frame.header, codec.FrameLimits())
    assert [d.is_cuda for d in transport._fresh_destinations(header)] == [True]


@pytest.mark.gpu
def test_host_buffers_through_shared_memory_land_on_a_gpu_receiver(ucx_loop):
    """A CPU sender's buffer in shared memory, received into fresh device memory."""
    seen: list[torch.Tensor] = []

    def keep(message: m.Message):
        if isinstance(message, m.Echo):
            seen.append(message.payload)
        return None

    async def scenario():
        async with started(keep, receive_device="cuda") as receiver, started(serve_echo) as sender:
            payloads = [torch.randn(1 << 18), torch.randn(5 << 20)]  # 1 MiB, and 20 MiB (a worker thread)
            for payload in payloads:
                assert await sender.request(receiver.address, m.Echo(payload)) == m.Ack()
            assert sender.uses_shared_memory(receiver.address)
            return payloads
    payloads = run_bounded(ucx_loop, scenario(), 60)
    assert [p.is_cuda for p in seen] == [True, True]
    assert all(torch.equal(p.cpu(), q) for p, q in zip(seen, payloads))



def test_a_request_that_stops_waiting_mid_send_leaves_the_others_on_its_connection(ucx_loop, start_peer):
    """A large request whose caller times out or is cancelled while UCX still sends it: its
    frame is posted whole and goes on; the connection, and the requests on it, are unharmed."""
    peer = start_peer("serve")

    async def scenario():
        async with started(serve_echo, shared_memory_bytes=0) as sender:  # the bytes go over UCX: slow enough
            await sender.connect(peer.address)
            big = torch.randn(16 << 20)  # 64 MiB
            slow = asyncio.ensure_future(sender.request(peer.address, m.Drain(epoch=1, drain_id=300, inst_id=5)))
            with pytest.raises(RequestTimeout):
                await sender.request(peer.address, m.Echo(big), timeout_s=0.001)
            cancelled = asyncio.ensure_future(sender.request(peer.address, m.Echo(big)))
            await asyncio.sleep(0.005)
            cancelled.cancel()
            await asyncio.gather(cancelled, return_exceptions=True)
            assert await slow == m.Ack()  # not PeerUnreachable: the connection lived on
            payload = torch.randn(1 << 16)
            assert torch.equal((await sender.request(peer.address, m.Echo(payload))).payload, payload)
            assert not sender._outbound[peer.address].pending
    run_bounded(ucx_loop, scenario(), 60)


@pytest.mark.parametrize("answers_at_once", [True, False])
def test_a_reply_that_cannot_be_encoded_is_an_error_reply(ucx_loop, answers_at_once):
    """A handler whose reply cannot travel (a non-contiguous tensor): the requester hears why at
    once, and the connection serves on."""
    def reply_of(message: m.Message):
        if isinstance(message, m.Echo) and message.payload.numel() == 64:
            return m.EchoReply(message.payload.view(8, 8).t())
        return m.EchoReply(message.payload) if isinstance(message, m.Echo) else None

    async def later(message: m.Message):
        return reply_of(message)

    async def scenario():
        async with started(reply_of if answers_at_once else later) as server, started(serve_echo) as sender:
            started_at = time.monotonic()
            with pytest.raises(RemoteError) as info:
                await sender.request(server.address, m.Echo(torch.randn(64)), timeout_s=5)
            assert info.value.code == m.ErrorCode.HANDLER_FAILED and "could not be encoded" in info.value.detail
            assert time.monotonic() - started_at < 2
            payload = torch.randn(16)
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)
    run_bounded(ucx_loop, scenario(), 30)


@pytest.mark.parametrize("answers_at_once", [True, False])
def test_a_handler_that_returns_no_message_is_answered_handler_failed(ucx_loop, answers_at_once):
    """A handler that returns something that is not a message (a dict): the requester hears
    why at once, and the connection serves on."""
    def reply_of(message: m.Message):
        if isinstance(message, m.Echo) and message.payload.numel() == 64:
            return {"not": "a message"}
        return m.EchoReply(message.payload) if isinstance(message, m.Echo) else None

    async def later(message: m.Message):
        return reply_of(message)

    async def scenario():
        async with started(reply_of if answers_at_once else later) as server, started(serve_echo) as sender:
            started_at = time.monotonic()
            with pytest.raises(RemoteError) as info:
                await sender.request(server.address, m.Echo(torch.randn(64)), timeout_s=5)
            assert info.value.code == m.ErrorCode.HANDLER_FAILED and info.value.detail == "TypeError: the handler returned a dict, not a message"
            assert time.monotonic() - started_at < 2
            payload = torch.randn(16)
            assert torch.equal((await sender.request(server.address, m.Echo(payload))).payload, payload)
    run_bounded(ucx_loop, scenario(), 30)


def test_close_ends_a_connect_in_progress(ucx_loop, start_peer):
    """A request that is still connecting when its transport closes fails; nothing stays open."""
    peer = start_peer("serve")

    async def scenario():
        transport = UcxTransport(TransportConfig(request_timeout_s=10))
        await transport.start(serve_echo)
        request = asyncio.ensure_future(transport.request(peer.address, m.Ack()))
        await asyncio.sleep(0)  # connecting
        await transport.close()
        with pytest.raises(PeerUnreachable):
            await request
        assert not transport._outbound and not transport._tasks and not transport._connecting
    run_bounded(ucx_loop, scenario(), 30)


def test_a_frame_behind_a_large_transfer_is_served_before_it_lands(ucx_loop):
    """The listener posts a frame's buffer receives and goes on to the next frame: a small
    request sent after a large one on the same connection is answered while the large one's
    buffer is still on its way (its handler has not run), and both are answered right."""
    handled: list[int] = []

    async def serve(message: m.Message) -> m.Message | None:
        handled.append(message.payload.numel())
        return m.EchoReply(message.payload[:1].clone())

    async def scenario():
        async with started(serve, shared_memory_bytes=0) as server, \
                started(serve_echo, shared_memory_bytes=0) as sender:
            await sender.request(server.address, m.Echo(torch.ones(1)))  # connected
            large, small = torch.randn(64 << 20), torch.full((4,), 7.0)
            large_reply = asyncio.ensure_future(sender.request(server.address, m.Echo(large)))
            await asyncio.sleep(0)  # posted first
            small_reply = await sender.request(server.address, m.Echo(small))
            answered_first = not large_reply.done()
            assert float((await large_reply).payload[0]) == float(large[0]) and float(small_reply.payload[0]) == 7.0
            return answered_first

    assert run_bounded(ucx_loop, scenario(), 60)
    assert handled == [1, 4, 64 << 20]


def test_a_reply_behind_a_large_reply_is_delivered_before_it_lands(ucx_loop):
    """The requester's side likewise: a small reply that comes after a large one on the same
    connection reaches its request while the large one is still on its way."""
    large = torch.randn(64 << 20)

    async def serve(message: m.Message) -> m.Message | None:
        return m.EchoReply(large if message.payload.numel() == 1 else message.payload)

    async def scenario():
        async with started(serve, shared_memory_bytes=0) as server, \
                started(serve_echo, shared_memory_bytes=0) as sender:
            await sender.request(server.address, m.Echo(torch.ones(2)))  # connected
            large_reply = asyncio.ensure_future(sender.request(server.address, m.Echo(torch.ones(1))))
            await asyncio.sleep(0)  # posted first
            small_reply = await sender.request(server.address, m.Echo(torch.full((4,), 7.0)))
            answered_first = not large_reply.done()
            assert torch.equal((await large_reply).payload, large)
            assert torch.equal(small_reply.payload, torch.full((4,), 7.0))
            return answered_first

    assert run_bounded(ucx_loop, scenario(), 60)


def test_an_unexpected_failure_while_a_frame_lands_in_the_background_fails_its_request_at_once(ucx_loop, monkeypatch):
    """A frame with a buffer over UCX lands in a task; a failure there that is no protocol error
    (a device copy's, say) closes the connection as it would in the connection's loop: the
    requester hears at once instead of at its timeout, and its shared-memory slots are freed."""
    from infinite_llm.transport.shared_memory import PeerRegion
    seen: list[m.Message] = []

    def keep(message: m.Message):
        seen.append(message)
        return None

    def failing_copy(region, view, offset, nbytes):
        raise RuntimeError("a device copy failed")

    run_bytes = filled_blocks(0, 16).numel() * 4
    monkeypatch.setattr(PeerRegion, "copy_to", failing_copy)

    async def scenario():
        # The sender's region holds the first run only: the second goes over UCX, in a task.
        async with started(keep) as server, started(serve_echo, shared_memory_bytes=4096 + run_bytes) as sender:
            await sender.connect(server.address)
            assert sender.uses_shared_memory(server.address)
            runs = (m.BlockRun(0, 16), m.BlockRun(32, 16))
            started_at = time.monotonic()
            with pytest.raises(PeerUnreachable):
                await sender.request(server.address, m.KVBlocks(1, 7, runs, (filled_blocks(0, 16), filled_blocks(32, 16))),
                                     timeout_s=5)
            assert time.monotonic() - started_at < 2
            assert seen == [] and not server._inbound
    run_bounded(ucx_loop, scenario(), 30)


def test_a_connection_with_work_in_flight_is_not_idle(ucx_loop):
    """Idle timeouts of 1 s on both sides and a handler that answers after 2 s: neither side
    closes the connection while the request waits for its answer."""
    async def slow_echo(message: m.Message) -> m.Message | None:
        await asyncio.sleep(2.0)
        return m.EchoReply(message.payload)

    async def scenario():
        async with started(slow_echo, idle_timeout_s=1.0) as server, started(serve_echo, idle_timeout_s=1.0) as client:
            reply = await client.request(server.address, m.Echo(torch.ones(4)), timeout_s=5)
            assert reply.payload.tolist() == [1.0] * 4
            # Idle now: both ends close within about their timeout.
            deadline = time.monotonic() + 5
            while (server._inbound or client._outbound) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not server._inbound and not client._outbound
    run_bounded(ucx_loop, scenario(), 30)


def test_a_connection_that_only_sends_is_not_idle_while_it_sends(ucx_loop):
    """One-way messages every 0.1 s for 2 s with idle timeouts of 0.5 s: no reply ever comes
    on the sender's side, yet the connection is the same throughout; once the sends stop, it
    closes within about the timeout."""
    received: list[int] = []

    def count(message: m.Message) -> None:
        if isinstance(message, m.Drain):
            received.append(message.drain_id)

    async def scenario():
        async with started(count, idle_timeout_s=0.5) as server, \
                started(lambda message: None, idle_timeout_s=0.5) as client:
            await client.connect(server.address)
            connection = client._outbound[server.address]
            for i in range(20):
                await client.send(server.address, m.Drain(epoch=1, drain_id=i, inst_id=1))
                await asyncio.sleep(0.1)
                assert client._outbound.get(server.address) is connection, f"closed after {i + 1} sends"
            deadline = time.monotonic() + 5
            while client._outbound and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not client._outbound
    run_bounded(ucx_loop, scenario(), 30)
    assert received == list(range(20))


def test_device_ready_reaches_the_encode_of_every_request_path(ucx_loop, start_peer, client, monkeypatch):
    """``request``, ``request_soon`` on an open connection and ``request_soon`` that connects
    first (a task) all hand ``device_ready`` to the codec, which then skips its stream wait."""
    peer = start_peer("serve")
    seen: list[bool] = []
    encode = codec.encode

    def recording_encode(message, msg_id, **kwargs):
        if isinstance(message, m.Echo):
            seen.append(kwargs.get("device_ready", False))
        return encode(message, msg_id, **kwargs)

    monkeypatch.setattr(codec, "encode", recording_encode)

    async def scenario():
        assert not client._outbound.get(peer.address)  # the first request_soon connects: a task
        await client.request_soon(peer.address, m.Echo(torch.arange(3)), device_ready=True)
        await client.request_soon(peer.address, m.Echo(torch.arange(3)), device_ready=True)
        await client.request(peer.address, m.Echo(torch.arange(3)), device_ready=True)
        await client.request(peer.address, m.Echo(torch.arange(3)))
    run_bounded(ucx_loop, scenario(), 30)
    assert seen == [True, True, True, False]
