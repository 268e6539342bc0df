"""Frame headers between UCX transports of one host travel through header rings in shared
memory (``transport/header_ring.py``), on loopback (UCX_TLS=tcp,sm,self).

After connect each connection has a ring per direction; headers that do not fit one go over
UCX; a ring turned off on either side leaves every header on UCX; a listener asleep is woken
by the ring's doorbell; garbage in a ring is refused and the connection made afresh; a killed
peer is noticed through the UCX header receive that stays posted; the ring files are gone once
the handshake ends. Peers named as processes are real ones, killed with SIGKILL.

Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.codec import FrameLimits
from infinite_llm.transport.errors import PeerUnreachable, RemoteError
from infinite_llm.transport.header_ring import PeerHeaderRing
from infinite_llm.transport.interface import PeerAddress

import polling_testlib
from conftest import run_bounded
from test_codec_fuzz import STRATEGIES
from test_ucx_loopback import Peer

ucxx = pytest.importorskip("ucxx")
from infinite_llm.transport.ucx import UcxTransport  # noqa: E402  (after the skip)
from ucx_testlib import started  # noqa: E402

SMALL_RING_BYTES = 64 << 10  # the smallest ring: headers over 16 KiB - 8 bytes go over UCX
_RING_FILE = re.compile(r"\.?infllm-(\d+)-[0-9a-f]{16}\.(ring|bell)\Z")
# Looked at every 5 ms: what these tests wait for comes within milliseconds, and they wait often.
until = functools.partial(polling_testlib.until, poll_s=0.005)

# A peer process beside ucx_peer.py, for what that one does not do:
#   listen PORT        a listener whose waits sleep at once (spin_s=0); answers Echo
#   request HOST PORT  a requester that connects to HOST:PORT, is answered once, then idles
PEER_SCRIPT = """
import asyncio, sys
import torch
from infinite_llm.transport import messages as m
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.ucx import UcxTransport

def echo(message):
    return m.EchoReply(message.payload) if isinstance(message, m.Echo) else None

async def listen():
    transport = UcxTransport(TransportConfig(spin_s=0.0))
    await transport.start(echo)
    print(f"PORT {transport.address.port}", flush=True)
    await asyncio.sleep(3600)

async def request(host, port):
    transport = UcxTransport(TransportConfig())
    await transport.start(echo)
    reply = await transport.request(PeerAddress(host, port), m.Echo(torch.arange(4)), timeout_s=10)
    assert torch.equal(reply.payload, torch.arange(4))
    print(f"PORT {transport.address.port}", flush=True)
    await asyncio.sleep(3600)

if sys.argv[1] == "listen":
    asyncio.run(listen())
else:
    asyncio.run(request(sys.argv[2], int(sys.argv[3])))
"""


def handle(message: m.Message):
    """Echo echoes; TryMoveKV reserves num_blocks blocks (a reply as long as that asks); Drain
    sleeps drain_id ms in a task of its own, then Ack."""
    if isinstance(message, m.Echo):
        return m.EchoReply(message.payload)
    if isinstance(message, m.TryMoveKV):
        return m.MoveReserved(message.move_id, 1, tuple(range(message.num_blocks)), 1000)
    if isinstance(message, m.Drain):
        return asyncio.sleep(message.drain_id / 1000)
    return None


@pytest.fixture
def shm_dir() -> Iterator[str]:
    """A directory of its own in /dev/shm, for both ends' shared-memory files."""
    directory = tempfile.mkdtemp(prefix="ringtest-", dir="/dev/shm")
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def start_peer(peer_command) -> Iterator:
    """Starts peer processes (``ucx_peer.py`` arguments, or PEER_SCRIPT's with ``script``);
    kills them all at the end."""
    peers: list[Peer] = []

    def start(*args: str, script: bool = False) -> Peer:
        peers.append(Peer([sys.executable, "-c", PEER_SCRIPT] if script else peer_command, *args))
        return peers[-1]

    yield start
    for peer in peers:
        peer.kill()


def ring_files(directory: str, pids: tuple[int, ...] | None = None) -> list[str]:
    """The ring and doorbell files in ``directory`` (those made by ``pids`` only, if given),
    finished or half made."""
    found = []
    for name in os.listdir(directory):
        match = _RING_FILE.match(name)
        if match and (pids is None or int(match.group(1)) in pids):
            found.append(name)
    return sorted(found)


def payload_of(seed: int, nbytes: int = 1024) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


async def posted(*connections) -> tuple:
    """The UCX header receives posted on ``connections`` (each reader posts its next one when it
    next loops)."""
    await until(lambda: all(c.header_request is not None for c in connections), 2.0, "a header receive posted")
    return tuple(c.header_request for c in connections)


def only_inbound(server: UcxTransport):
    assert len(server._inbound) == 1, server._inbound
    return next(iter(server._inbound))


async def connected(client: UcxTransport, server: UcxTransport) -> tuple:
    """Connect ``client`` to ``server``: the client's outbound connection and the server's
    inbound one."""
    await client.connect(server.address)
    return client._outbound[server.address], only_inbound(server)


async def echo_checked(client: UcxTransport, peer: PeerAddress, payload: torch.Tensor) -> None:
    reply = await client.request(peer, m.Echo(payload))
    assert torch.equal(reply.payload, payload)


def test_after_connect_both_sides_have_rings_and_small_headers_go_only_through_them(ucx_loop, shm_dir):
    """Both connections have a ring per direction once ``connect`` returns (the listener's own
    offered ring moved to ``ring_out``). 200 round trips of 1 KiB Echo go through the rings:
    each side's write position advances by at least the payloads' bytes, the reader consumes
    all of it, and the UCX header receive posted on each side is the same request throughout
    (no header came over UCX)."""
    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            outbound, inbound = await connected(client, server)
            assert outbound.ring_out is not None and outbound.ring_in is not None
            assert inbound.ring_in is not None and inbound.ring_out is not None
            assert inbound.ring_offered is None and outbound.ring_offered is None
            # Each side reads the ring the other writes.
            assert inbound.ring_in.name == outbound.ring_out.name
            assert outbound.ring_in.name == inbound.ring_out.name
            await echo_checked(client, server.address, payload_of(0))  # the receives are posted
            client_request, server_request = await posted(outbound, inbound)
            assert client_request is not None and server_request is not None
            client_pos, server_pos = outbound.ring_out._write_pos, inbound.ring_out._write_pos
            for i in range(1, 201):
                await echo_checked(client, server.address, payload_of(i))
            assert outbound.ring_out._write_pos - client_pos >= 200 * 1024
            assert inbound.ring_out._write_pos - server_pos >= 200 * 1024
            assert inbound.ring_in._read_pos == outbound.ring_out._write_pos
            assert outbound.ring_in._read_pos == inbound.ring_out._write_pos
            assert outbound.header_request is client_request and not client_request.completed
            assert inbound.header_request is server_request and not server_request.completed
            assert client._outbound[server.address] is outbound  # one connection throughout
    run_bounded(ucx_loop, scenario(), 30)


def test_headers_too_big_for_the_ring_go_over_ucx_beside_small_ones_through_it(ucx_loop, shm_dir):
    """With a 64 KiB ring (headers up to 16 KiB - 8 bytes): a 20 KiB inline Echo goes over UCX
    both ways (the rings' positions stay put, a UCX header arrives on each side); a small
    TryMoveKV whose MoveReserved reply (4000 block ids) is too big goes by the ring one way and
    UCX the other; and a mix of big and small in flight at once all come back whole."""
    config = dict(shared_memory_dir=shm_dir, header_ring_bytes=SMALL_RING_BYTES,
                  limits=FrameLimits(inline_limit_bytes=32 << 10))

    async def scenario():
        async with started(handle, **config) as server, started(handle, **config) as client:
            outbound, inbound = await connected(client, server)
            assert outbound.ring_out.max_header_bytes == (16 << 10) - 8
            await echo_checked(client, server.address, payload_of(0))

            # Too big both ways: over UCX, the rings untouched.
            client_pos, server_pos = outbound.ring_out._write_pos, inbound.ring_out._write_pos
            client_request, server_request = await posted(outbound, inbound)
            await echo_checked(client, server.address, payload_of(1, 20 << 10))
            assert outbound.ring_out._write_pos == client_pos
            assert inbound.ring_out._write_pos == server_pos
            assert inbound.header_request is not server_request  # the request's header came over UCX
            assert outbound.header_request is not client_request  # and so did the reply's

            # A small request by the ring, its big reply over UCX.
            client_request, server_request = await posted(outbound, inbound)
            reserved = await client.request(server.address, m.TryMoveKV(1, 5, 1, 1, 1, 4000, 4096))
            assert reserved == m.MoveReserved(5, 1, tuple(range(4000)), 1000)
            assert outbound.ring_out._write_pos > client_pos
            assert inbound.ring_out._write_pos == server_pos
            assert inbound.header_request is server_request
            assert outbound.header_request is not client_request

            # Big and small at once, interleaved.
            client_pos, server_pos = outbound.ring_out._write_pos, inbound.ring_out._write_pos
            payloads = [payload_of(10 + i, (20 << 10) if i % 2 else 1024) for i in range(24)]
            replies = await asyncio.gather(*(client.request(server.address, m.Echo(p)) for p in payloads))
            for payload, reply in zip(payloads, replies):
                assert torch.equal(reply.payload, payload)
            # The 12 small ones went through the rings, the 12 big ones did not.
            assert 12 * 1024 <= outbound.ring_out._write_pos - client_pos < 12 * 2048
            assert 12 * 1024 <= inbound.ring_out._write_pos - server_pos < 12 * 2048
            assert client._outbound[server.address] is outbound and not outbound.broken
    run_bounded(ucx_loop, scenario(), 30)


def test_headers_the_full_ring_has_no_room_for_go_over_ucx(ucx_loop, shm_dir):
    """40 requests of 4 KiB posted back to back (``request_soon``: no await between them) fill
    a 64 KiB ring that its reader has not yet looked at: those that find no room go over UCX,
    and every request gets its own reply."""
    config = dict(shared_memory_dir=shm_dir, header_ring_bytes=SMALL_RING_BYTES)

    async def scenario():
        async with started(handle, **config) as server, started(handle, **config) as client:
            await client.connect(server.address)
            outbound = client._outbound[server.address]
            await echo_checked(client, server.address, payload_of(0))
            client_pos = outbound.ring_out._write_pos
            (server_request,) = await posted(only_inbound(server))
            payloads = [payload_of(100 + i, 4096) for i in range(40)]
            pending = [client.request_soon(server.address, m.Echo(p)) for p in payloads]
            written = outbound.ring_out._write_pos - client_pos
            assert 0 < written <= SMALL_RING_BYTES  # the ring took what it had room for ...
            assert written < 40 * 4096  # ... and no more: the rest went over UCX
            replies = await asyncio.gather(*pending)
            for payload, reply in zip(payloads, replies):
                assert torch.equal(reply.payload, payload)
            assert only_inbound(server).header_request is not server_request  # UCX headers came
            assert client._outbound[server.address] is outbound and not outbound.broken
    run_bounded(ucx_loop, scenario(), 30)


def test_headers_are_handled_in_the_order_they_were_sent_whichever_way_each_went(ucx_loop, shm_dir):
    """Requests posted back to back fill a small ring, and the rest go over UCX, while the
    listener's replies fill its ring the same way: the listener handles the requests, and the
    requester reads the replies, in the order they were sent (a record waits for the headers
    its producer sent over UCX before it)."""
    config = dict(shared_memory_dir=shm_dir, header_ring_bytes=SMALL_RING_BYTES)
    handled: list[int] = []

    def recording(message: m.Message):
        if isinstance(message, m.Echo):
            handled.append(int(message.payload[:8].view(torch.int64)[0]))
            return m.EchoReply(message.payload)
        return None

    async def scenario():
        async with started(recording, **config) as server, started(handle, **config) as client:
            await client.connect(server.address)
            outbound = client._outbound[server.address]
            for round_ in range(3):
                handled.clear()
                payloads = []
                for i in range(60):
                    payload = payload_of(1000 * round_ + i, 4096)
                    payload[:8] = torch.tensor([i], dtype=torch.int64).view(torch.uint8)
                    payloads.append(payload)
                sent_over_ucx = outbound.ucx_headers_sent
                pending = [client.request_soon(server.address, m.Echo(p)) for p in payloads]
                assert outbound.ucx_headers_sent > sent_over_ucx  # some went over UCX ...
                replies = await asyncio.gather(*pending)
                assert handled == list(range(60))  # ... and all were handled in order
                for payload, reply in zip(payloads, replies):
                    assert torch.equal(reply.payload, payload)
                inbound = only_inbound(server)
                assert inbound.ucx_headers_taken == outbound.ucx_headers_sent
                assert outbound.ucx_headers_taken == inbound.ucx_headers_sent
    run_bounded(ucx_loop, scenario(), 30)


def test_a_second_ring_offer_on_a_connection_is_refused_and_the_first_rings_serve_on(ucx_loop, shm_dir):
    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            outbound, inbound = await connected(client, server)
            first = (inbound.ring_in.name, inbound.ring_out.name)
            with pytest.raises(RemoteError) as info:
                await client.request(server.address, m.HeaderRingOffer(ring="infllm-1-0123456789abcdef.ring",
                                                                         nonce="00" * 16))
            assert info.value.code == m.ErrorCode.SHARED_MEMORY_UNAVAILABLE
            assert client._outbound[server.address] is outbound  # an answer, not a refusal
            assert (inbound.ring_in.name, inbound.ring_out.name) == first and inbound.ring_offered is None
            before = outbound.ring_out._write_pos
            for i in range(10):
                await echo_checked(client, server.address, payload_of(i))
            assert outbound.ring_out._write_pos > before and not outbound.broken
    run_bounded(ucx_loop, scenario(), 30)


def test_an_offered_ring_the_requester_cannot_open_loses_its_names_and_replies_stay_on_ucx(
        ucx_loop, shm_dir, monkeypatch):
    """The requester could not open the listener's ring (here: refused on purpose), so it never
    says it opened it: the listener's replies stay on UCX, and the offered ring's files go
    after ``OFFERED_RING_NAMES_S``, not with the connection."""
    from infinite_llm.transport import ucx as ucx_module
    from infinite_llm.transport.header_ring import HeaderRingUnavailable

    monkeypatch.setattr(ucx_module, "OFFERED_RING_NAMES_S", 0.3)
    real_open = PeerHeaderRing.open.__func__
    opens: list[str] = []
    opened_by_requester: list[str] = []

    def refusing_open(cls, directory, name, nonce_hex, max_header_bytes):
        # Both ends are in this process: the listener opens the requester's ring first, then
        # the requester the listener's.
        opens.append(name)
        if len(opens) == 2:
            opened_by_requester.append(name)
            raise HeaderRingUnavailable("refused by the test")
        return real_open(cls, directory, name, nonce_hex, max_header_bytes)

    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            monkeypatch.setattr(PeerHeaderRing, "open", classmethod(refusing_open))
            outbound, inbound = await connected(client, server)
            assert outbound.ring_out is not None and outbound.ring_in is None
            assert inbound.ring_in is not None and inbound.ring_out is None and inbound.ring_offered is not None
            assert opened_by_requester == [inbound.ring_offered.name]
            assert ring_files(shm_dir) != []  # the offered ring's names, for now
            await until(lambda: ring_files(shm_dir) == [], 5, "the offered ring's names removed")
            sent_over_ucx = inbound.ucx_headers_sent
            for i in range(5):
                await echo_checked(client, server.address, payload_of(i))
            assert inbound.ucx_headers_sent == sent_over_ucx + 5
    run_bounded(ucx_loop, scenario(), 30)


def test_rings_turned_off_on_the_listener_leave_every_header_on_ucx(ucx_loop, shm_dir):
    """``header_ring_bytes=0`` on the listener: it refuses the offer, the requester keeps no
    ring (the one it offered is closed and its files removed), neither side has one, and
    requests are answered with their headers over UCX."""
    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir, header_ring_bytes=0) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            outbound, inbound = await connected(client, server)
            assert (outbound.ring_out, outbound.ring_in, outbound.ring_offered) == (None, None, None)
            assert (inbound.ring_out, inbound.ring_in, inbound.ring_offered) == (None, None, None)
            assert ring_files(shm_dir) == []
            assert server.address not in client._ring_offer_refused  # refused, not unknown: asked again next time
            for i in range(5):
                (server_request,) = await posted(inbound)
                await echo_checked(client, server.address, payload_of(i))
                assert inbound.header_request is not server_request  # the header came over UCX
            assert client._outbound[server.address] is outbound and not outbound.broken
    run_bounded(ucx_loop, scenario(), 30)


def test_rings_turned_off_on_the_requester_mean_no_offer(ucx_loop, shm_dir, monkeypatch):
    """``header_ring_bytes=0`` on the requester: it offers nothing (the listener opens no ring
    and offers none), neither side has a ring, and requests are answered."""
    offers: list[m.Message] = []
    accept = UcxTransport._accept_header_ring
    monkeypatch.setattr(UcxTransport, "_accept_header_ring",
                        lambda self, connection, offer: offers.append(offer) or accept(self, connection, offer))

    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir, header_ring_bytes=0) as client:
            outbound, inbound = await connected(client, server)
            assert offers == []
            assert (outbound.ring_out, outbound.ring_in, outbound.ring_offered) == (None, None, None)
            assert (inbound.ring_out, inbound.ring_in, inbound.ring_offered) == (None, None, None)
            assert ring_files(shm_dir) == []
            for i in range(5):
                await echo_checked(client, server.address, payload_of(i))
            assert client._outbound[server.address] is outbound and not outbound.broken
    run_bounded(ucx_loop, scenario(), 30)


def test_a_sleeping_listener_is_woken_by_the_doorbell(ucx_loop, start_peer):
    """A listener process whose waits sleep at once (spin_s=0), so that nothing but a wake-up
    of its event loop reads a header: 50 sequential requests through the rings are answered
    at a median well under the 10 ms of UCX's safety tick, the only other thing that would
    look at the ring (the headers never touch the UCX worker, whose fd stays quiet)."""
    peer = start_peer("listen", script=True)

    async def scenario():
        async with started(handle) as client:  # the peer's directory: /dev/shm
            await client.connect(peer.address)
            outbound = client._outbound[peer.address]
            assert outbound.ring_out is not None and outbound.ring_in is not None
            await echo_checked(client, peer.address, payload_of(0))
            (client_request,) = await posted(outbound)
            position = outbound.ring_out._write_pos
            took = []
            for i in range(1, 51):
                started_at = time.monotonic()
                await echo_checked(client, peer.address, payload_of(i))
                took.append(time.monotonic() - started_at)
            assert outbound.ring_out._write_pos - position >= 50 * 1024  # through the ring
            assert outbound.header_request is client_request  # and the replies through the peer's
            assert sum(took) < 2.0, took
            assert statistics.median(took) < 3e-3, sorted(took)
            return statistics.median(took)
    print(f"median round trip to a sleeping listener: {run_bounded(ucx_loop, scenario(), 60) * 1e3:.2f} ms")


def test_garbage_in_the_ring_is_refused_and_the_next_request_connects_afresh(ucx_loop, shm_dir):
    """Bytes that are no frame written into the requester's ring: the listener refuses them
    (bad_magic) through its reply ring and closes the connection; the refusal is read before
    the close, so the request in flight there fails with RemoteError(bad_magic) at once. The
    next request makes a new connection with new rings, and the listener serves it."""
    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            outbound, old_inbound = await connected(client, server)
            old_rings = {outbound.ring_out.name, outbound.ring_in.name}
            in_flight = asyncio.ensure_future(client.request(server.address, m.Drain(1, 5000, 1)))
            await until(lambda: old_inbound.handling == 1, 5, "the Drain is being handled")
            assert outbound.ring_out.write(b"not a frame at all, just some bytes")
            started_at = time.monotonic()
            with pytest.raises(RemoteError) as info:
                await in_flight
            assert time.monotonic() - started_at < 2.0
            assert info.value.code == m.ErrorCode.BAD_MAGIC
            assert outbound.broken and server.address not in client._outbound
            assert outbound.ring_out.closed and outbound.ring_in.closed
            await until(lambda: old_inbound not in server._inbound, 5, "the listener closed the connection")
            assert old_inbound.broken

            await echo_checked(client, server.address, payload_of(1))
            fresh = client._outbound[server.address]
            assert fresh is not outbound
            assert fresh.ring_out is not None and fresh.ring_in is not None
            assert not {fresh.ring_out.name, fresh.ring_in.name} & old_rings
            new_inbound = only_inbound(server)
            assert new_inbound.ring_in.name == fresh.ring_out.name
            for i in range(2, 12):
                await echo_checked(client, server.address, payload_of(i))
    run_bounded(ucx_loop, scenario(), 30)


def test_a_killed_peer_is_noticed_while_headers_go_through_rings(ucx_loop, start_peer):
    """A peer process (rings on) killed with SIGKILL while Drain requests are in flight to it:
    they fail with PeerUnreachable within 2 s (the UCX header receive stays posted beside the
    ring), the connection's rings are closed, and no ring file of either process is left (they
    were removed at the handshake's end). A peer started again on a new port is reached, with
    new rings."""
    doomed = start_peer("serve")
    pids = (os.getpid(), doomed.process.pid)

    async def scenario():
        async with started(handle) as client:
            await client.connect(doomed.address)
            outbound = client._outbound[doomed.address]
            assert outbound.ring_out is not None and outbound.ring_in is not None
            assert ring_files("/dev/shm", (os.getpid(),)) == []
            # The peer removes its files right after it posts the handshake's last answer.
            await until(lambda: ring_files("/dev/shm", pids) == [], 2.0, "the peer's ring files removed")
            assert await client.request(doomed.address, m.Drain(1, 1, 1)) == m.Ack()
            (client_request,) = await posted(outbound)
            in_flight = [asyncio.ensure_future(client.request(doomed.address, m.Drain(1, 3000, 1)))
                         for _ in range(3)]
            await asyncio.sleep(0.2)
            assert outbound.header_request is client_request  # the Ack's header came by the ring
            killed_at = time.monotonic()
            doomed.kill()
            outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
            assert all(isinstance(o, PeerUnreachable) for o in outcomes), outcomes
            assert time.monotonic() - killed_at < 2.0
            assert outbound.broken and outbound.ring_out.closed and outbound.ring_in.closed
            assert ring_files("/dev/shm", pids) == []

            restarted = start_peer("serve")
            assert restarted.address != doomed.address
            await echo_checked(client, restarted.address, payload_of(1))
            fresh = client._outbound[restarted.address]
            assert fresh.ring_out is not None and fresh.ring_in is not None
            await until(lambda: ring_files("/dev/shm", (os.getpid(), restarted.process.pid)) == [], 2.0,
                        "the ring files of the new connection removed")
    run_bounded(ucx_loop, scenario(), 60)


def test_a_killed_requester_is_noticed_by_the_listener(ucx_loop, start_peer, shm_dir):
    """A requester process connected with rings, killed with SIGKILL while idle: the listener's
    inbound connection (waiting on the ring and on its posted UCX header receive) ends within
    2 s, its rings closed, and the listener serves a new connection."""
    async def scenario():
        async with started(handle) as server:  # the requester's directory: /dev/shm
            # Started on a thread: its start waits for its request, which this loop answers.
            requester = await asyncio.get_running_loop().run_in_executor(
                None, lambda: start_peer("request", server.address.host, str(server.address.port), script=True))
            inbound = only_inbound(server)
            assert inbound.ring_in is not None and inbound.ring_out is not None
            await asyncio.sleep(0.1)
            killed_at = time.monotonic()
            requester.kill()
            await until(lambda: inbound not in server._inbound, 2.0, "the listener noticed the kill")
            assert time.monotonic() - killed_at < 2.0
            assert inbound.broken and inbound.ring_in.closed and inbound.ring_out.closed
            async with started(handle, shared_memory_dir=shm_dir) as client:
                await echo_checked(client, server.address, payload_of(0))
    run_bounded(ucx_loop, scenario(), 60)


def test_ring_files_are_removed_once_the_handshake_ends(ucx_loop, shm_dir, monkeypatch):
    """The ring and doorbell files lie in the shared-memory directory while the peer opens
    them (seen there from inside ``PeerHeaderRing.open``, once per direction) and are gone
    once ``connect`` returns; requests through the rings and closing both transports leave
    none either."""
    seen_at_open: list[list[str]] = []
    real_open = PeerHeaderRing.open.__func__

    def recording_open(cls, directory, name, nonce_hex, max_header_bytes):
        seen_at_open.append(ring_files(directory))
        return real_open(cls, directory, name, nonce_hex, max_header_bytes)

    monkeypatch.setattr(PeerHeaderRing, "open", classmethod(recording_open))

    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server:
            async with started(handle, shared_memory_dir=shm_dir) as client:
                await client.connect(server.address)
                outbound = client._outbound[server.address]
                assert len(seen_at_open) == 2
                # The requester's ring, then the listener's, each with its bell.
                stems = [n.removesuffix(".ring") for n in (outbound.ring_out.name, outbound.ring_in.name)]
                assert seen_at_open[0] == [f"{stems[0]}.bell", f"{stems[0]}.ring"]
                assert seen_at_open[1] == [f"{stems[1]}.bell", f"{stems[1]}.ring"]
                assert ring_files(shm_dir) == []
                for i in range(20):
                    await echo_checked(client, server.address, payload_of(i))
                assert ring_files(shm_dir) == []
            assert ring_files(shm_dir) == []
        assert ring_files(shm_dir) == []
    run_bounded(ucx_loop, scenario(), 30)


def test_many_requests_in_flight_at_once_get_their_own_replies_through_the_rings(ucx_loop, shm_dir):
    """64 requests at once, each with its own payload, plus slow Drains among them: every
    reply is its own request's, and the headers all went through the rings."""
    async def scenario():
        async with started(handle, shared_memory_dir=shm_dir) as server, \
                started(handle, shared_memory_dir=shm_dir) as client:
            await client.connect(server.address)
            outbound = client._outbound[server.address]
            await echo_checked(client, server.address, payload_of(0))
            inbound = only_inbound(server)
            client_request, server_request = await posted(outbound, inbound)
            client_pos, server_pos = outbound.ring_out._write_pos, inbound.ring_out._write_pos
            slow = [client.request(server.address, m.Drain(1, 200, 1)) for _ in range(4)]
            payloads = [payload_of(1000 + i, 512 + 8 * i) for i in range(64)]
            replies = await asyncio.gather(*(client.request(server.address, m.Echo(p)) for p in payloads), *slow)
            for payload, reply in zip(payloads, replies):
                assert torch.equal(reply.payload, payload)
            assert replies[64:] == [m.Ack()] * 4
            payload_bytes = sum(p.numel() for p in payloads)
            assert outbound.ring_out._write_pos - client_pos >= payload_bytes
            assert inbound.ring_out._write_pos - server_pos >= payload_bytes
            assert outbound.header_request is client_request
            assert inbound.header_request is server_request
    run_bounded(ucx_loop, scenario(), 30)


# --- a live listener refuses whatever malformed header comes through the ring ---------------


def refused_as_it_is(data: bytes) -> bool:
    """Whether a listener must refuse ``data`` read from a ring (exactly these bytes: a ring
    carries a header's length, no zero padding as a UCX receive buffer would add)."""
    try:
        codec.decode_header(data, codec.FrameLimits())
    except Exception:  # noqa: BLE001  (any refusal counts here)
        return True
    return False


def live_ring_fuzz(ucx_loop, peer: Peer, examples: int) -> None:
    """Each malformed header goes into the requester's ring of a fresh connection to a real
    listener process, behind a slow request: that request fails at once (RemoteError where
    the refusal answers it or names no request, PeerUnreachable where it answers the bad
    frame's own id), and the listener serves on."""
    frames = st.one_of(*STRATEGIES.values()).filter(lambda data: 0 < len(data) and refused_as_it_is(data))

    async def one(client: UcxTransport, data: bytes) -> None:
        await client.connect(peer.address)
        outbound = client._outbound[peer.address]
        assert outbound.ring_out is not None and outbound.ring_in is not None
        slow = asyncio.ensure_future(client.request(peer.address, m.Drain(1, 5000, 1), timeout_s=10))
        await asyncio.sleep(0.005)
        assert outbound.ring_out.write(data)
        with pytest.raises((RemoteError, PeerUnreachable)):
            async with asyncio.timeout(2):
                await slow
        assert server_address_dropped(client, peer.address)

    async def scenario(datas: list[bytes]) -> None:
        async with started(lambda message: None) as client:
            for data in datas:
                await one(client, data)
            await echo_checked(client, peer.address, payload_of(7))

    batch: list[bytes] = []

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                     HealthCheck.data_too_large])
    @given(frames)
    def collect(data: bytes) -> None:
        batch.append(data)

    collect()
    run_bounded(ucx_loop, scenario(batch), 30 + examples * 0.5)
    assert peer.process.poll() is None


def server_address_dropped(client: UcxTransport, address: PeerAddress) -> bool:
    connection = client._outbound.get(address)
    return connection is None or connection.broken


def test_live_listener_ring_fuzz(ucx_loop, start_peer):
    live_ring_fuzz(ucx_loop, start_peer("serve"), examples=150)


@pytest.mark.slow
def test_live_listener_ring_fuzz_long(ucx_loop, start_peer):
    live_ring_fuzz(ucx_loop, start_peer("serve"), examples=3_000)


def test_a_ring_offered_with_its_read_position_off_a_records_start_is_refused_and_ucx_serves_on(
        ucx_loop, shm_dir):
    """A raw peer offers a ring whose read position sits 4 bytes short of the ring's end: the
    listener answers the offer with shared_memory_unavailable (reading from there would take a
    record's prefix across the ring's end), logs no failure of its own, and serves the
    connection's next request over UCX."""
    import numpy as np

    from infinite_llm.transport.header_ring import CONTROL_BYTES, MIN_DATA_BYTES, HeaderRing

    async def read_header(endpoint) -> codec.FrameHeader:
        buffer = np.zeros(1 << 16, np.uint8)
        await asyncio.wait_for(endpoint.recv(buffer), 5.0)
        return codec.decode_header(buffer[:codec.frame_length(buffer[:codec.PREAMBLE.size])].tobytes(),
                                   FrameLimits())

    async def scenario():
        async with started(handle, shared_memory_bytes=0, shared_memory_dir=shm_dir) as server:
            producer = HeaderRing(shm_dir, MIN_DATA_BYTES)
            control = np.memmap(os.path.join(shm_dir, producer.name), dtype="<u8", mode="r+",
                                shape=(CONTROL_BYTES // 8,))
            control[16] = control[8] = MIN_DATA_BYTES - 4
            endpoint = await ucxx.create_endpoint("127.0.0.1", server.address.port)
            try:
                offer = codec.encode(m.HeaderRingOffer(ring=producer.name, nonce=producer.nonce.hex()), 1).header
                await endpoint.send(np.frombuffer(offer, np.uint8))
                answer = await read_header(endpoint)
                ping = codec.encode(m.Echo(torch.arange(16, dtype=torch.uint8)), 2).header
                await endpoint.send(np.frombuffer(ping, np.uint8))
                echoed = await read_header(endpoint)
            finally:
                endpoint.abort()
                del control
                producer.close()
            return answer, echoed

    answer, echoed = run_bounded(ucx_loop, scenario(), 30)
    assert isinstance(answer.message, m.ErrorReply)
    assert answer.message.code == m.ErrorCode.SHARED_MEMORY_UNAVAILABLE
    assert "not on a record's start" in answer.message.detail
    assert isinstance(echoed.message, m.EchoReply) and echoed.reply_to == 2
