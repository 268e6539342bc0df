"""An in-memory transport with the UCX transport's interface, on a fake clock.

Every message goes through the real codec (encode, header checks, placement, byte copy,
assemble), so tests above the transport see exactly what UCX would deliver. Delivery is FIFO
on the event loop; time moves only with ``FakeClock.tick``, so timeouts are deterministic.
The network records a trace of every frame and can kill or silence an instance:

- ``kill(address)``: what UCX shows for a SIGKILLed peer: requests waiting on it fail with
  PeerUnreachable at once, and so do new ones until a transport starts at that address again.
  The killed transport does nothing more: its running handlers are cancelled, and nothing it
  would still send (a reply, a one-way message) leaves.
- ``silence(address)``: frames to and from it vanish; requests time out on the fake clock,
  as with a hung peer, which only the daemons' heartbeats notice.

As on UCX, where a reply travels only on its request's connection, a reply goes to the
transport instance that sent the request, never to another at its address (one started there
since, whose message ids begin at 1 again); a reply to a closed or killed requester is lost.
A frame its receiver refuses (``ProtocolError``: over the receiver's limits, a field of the
wrong type) is answered as the UCX listener answers it: an ``ErrorReply`` that fails the
sender's requests in flight to that receiver with ``RemoteError`` (UCX closes the connection,
failing every request on it), at once rather than at their timeouts. A reply the requester
refuses fails its requests to that peer with the ``ProtocolError``, as UCX drops the connection.
"""

from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from infinite_llm.transport import codec
from infinite_llm.transport.errors import (
    PeerUnreachable,
    PlacementRefused,
    ProtocolError,
    RemoteError,
    RequestTimeout,
)
from infinite_llm.transport.interface import (
    BufferPlacer,
    MessageHandler,
    PeerAddress,
    TransportConfig,
)
from infinite_llm.transport.messages import Ack, ErrorCode, ErrorReply, Message
from infinite_llm.transport.device_pools import PoolRows, check_rows, pool_key, pull_rows, row_words
from infinite_llm.transport.tensors import allocate, copy_bytes


class FakeClock:
    """Seconds that pass only when a test says so."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now_s = start_s
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()
        self._cancelled: set[int] = set()

    def now(self) -> float:
        return self._now_s

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> int:
        """Run ``callback`` once the clock reaches now + ``delay_s``; returns a timer id."""
        timer_id = next(self._order)
        heapq.heappush(self._timers, (self._now_s + delay_s, timer_id, callback))
        return timer_id

    def cancel(self, timer_id: int) -> None:
        self._cancelled.add(timer_id)

    def tick(self, seconds: float) -> None:
        """Advance by ``seconds``, firing due timers in deadline order."""
        target = self._now_s + seconds
        while self._timers and self._timers[0][0] <= target:
            deadline, timer_id, callback = heapq.heappop(self._timers)
            self._now_s = max(self._now_s, deadline)
            if timer_id in self._cancelled:
                self._cancelled.discard(timer_id)
                continue
            callback()
        self._now_s = target


@dataclass(frozen=True)
class TraceEvent:
    time_s: float  # fake clock
    src: PeerAddress
    dst: PeerAddress
    message_type: str  # Message.TYPE
    msg_id: int
    reply_to: int | None
    outcome: str  # "delivered" | "dropped" (silenced) | "unreachable" (no listener, or the requester is gone)


@dataclass
class _PendingRequest:
    future: asyncio.Future
    timer_id: int
    peer: PeerAddress
    message_type: str


class InMemoryNetwork:
    """Connects in-memory transports by address."""

    def __init__(self, clock: FakeClock | None = None, maps_pools: bool = False) -> None:
        self.clock = clock or FakeClock()
        # Whether a transport's pools are read in place by its peers (``map_device_pool``), as
        # UCX peers on one GPU read each other's device pools: a move's rows then travel as
        # their ids, and the receiver copies them out of the sender's pool.
        self.maps_pools = maps_pools
        self._pools: dict[tuple[PeerAddress, int], object] = {}  # (owner, pool id) -> row bytes
        self.trace: list[TraceEvent] = []
        self._listeners: dict[PeerAddress, InMemoryTransport] = {}  # started, serving
        self._transports: dict[PeerAddress, InMemoryTransport] = {}  # alive, may await replies
        self._silenced: set[PeerAddress] = set()
        self._in_flight = 0
        self._next_port = itertools.count(1)

    def transport(
        self, address: PeerAddress | None = None, config: TransportConfig | None = None
    ) -> InMemoryTransport:
        if address is None:
            address = PeerAddress("memory", next(self._next_port))
        transport = InMemoryTransport(self, address, config or TransportConfig())
        self._transports[address] = transport
        return transport

    def kill(self, address: PeerAddress) -> None:
        killed = {id(t): t for t in (self._listeners.pop(address, None), self._transports.pop(address, None))
                  if t is not None}
        for transport in killed.values():
            transport._closed = True  # before anything below runs: it sends nothing more
            transport._fail_all(PeerUnreachable(address, "killed"))
            transport._cancel_tasks()  # as a SIGKILLed process, it finishes nothing it was doing
        self._fail_requests_to(address, PeerUnreachable(address, "connection reset"))
        self._forget_pools(address)

    def _forget_pools(self, address: PeerAddress) -> None:
        """A gone transport's pools are read no more (as its CUDA memory is unmapped)."""
        for key in [key for key in self._pools if key[0] == address]:
            del self._pools[key]

    def _fail_requests_to(self, address: PeerAddress, error: Exception) -> None:
        """Every live transport, serving or only requesting: its requests to ``address`` break."""
        for other in {id(t): t for t in (*self._transports.values(), *self._listeners.values())}.values():
            other._fail_requests_to(address, error)

    def silence(self, address: PeerAddress) -> None:
        self._silenced.add(address)

    def unsilence(self, address: PeerAddress) -> None:
        self._silenced.discard(address)

    async def settle(self, max_rounds: int = 10_000) -> None:
        """Let every queued delivery and every handler run until nothing is left to do."""
        for _ in range(max_rounds):
            if self._in_flight == 0:
                await asyncio.sleep(0)
                if self._in_flight == 0:
                    return
            await asyncio.sleep(0)
        raise RuntimeError(f"network still busy after {max_rounds} rounds")

    def messages(self) -> list[tuple[str, str, str]]:
        """The trace as (src, dst, type) for delivered frames: what tests usually assert."""
        return [(str(e.src), str(e.dst), e.message_type)
                for e in self.trace if e.outcome == "delivered"]

    # --- used by InMemoryTransport ---

    def _post(self, sender: InMemoryTransport, dst: PeerAddress, frame: codec.EncodedFrame,
              message: Message, msg_id: int, reply_to: int | None,
              requester: InMemoryTransport | None = None) -> bool:
        """Queue a frame: a request or one-way message to the listener at ``dst``, or, where
        ``requester`` is given, a frame on the way back to that transport instance (a reply, or
        a refusal). False when nothing listens at ``dst`` or the requester is gone. A closed or
        killed sender sends nothing."""
        if sender._closed:
            return True  # gone: nothing leaves it, and nothing is traced
        src = sender.address

        def event(outcome: str) -> None:
            self.trace.append(TraceEvent(self.clock.now(), src, dst, message.TYPE, msg_id,
                                         reply_to, outcome))

        if src in self._silenced or dst in self._silenced:
            event("dropped")
            return True
        receiver = self._listeners.get(dst) if requester is None else requester
        if receiver is None or receiver._closed:
            event("unreachable")
            return False
        event("delivered")
        self._in_flight += 1
        asyncio.get_running_loop().call_soon(self._deliver, receiver, sender, frame, requester is not None)
        return True

    def _deliver(self, receiver: InMemoryTransport, sender: InMemoryTransport,
                 frame: codec.EncodedFrame, on_reply_path: bool) -> None:
        if receiver._closed:  # killed or closed since the frame was queued: no handler runs
            self._in_flight -= 1
            return
        if on_reply_path:
            receiving = receiver._take_replies(sender.address, frame)
        else:
            receiving = receiver._receive(sender, frame)
        task = asyncio.get_running_loop().create_task(receiving)
        receiver._tasks.add(task)
        task.add_done_callback(receiver._tasks.discard)
        task.add_done_callback(self._delivered)

    def _delivered(self, _task: asyncio.Task) -> None:
        self._in_flight -= 1


class InMemoryTransport:
    """One instance's end of an ``InMemoryNetwork``; implements ``Transport``."""

    def __init__(self, network: InMemoryNetwork, address: PeerAddress,
                 config: TransportConfig) -> None:
        self._network = network
        self._address = address
        self._config = config
        self._handler: MessageHandler | None = None
        self._placer: BufferPlacer | None = None
        self._pending: dict[int, _PendingRequest] = {}
        self._next_msg_id = itertools.count(1)
        self._closed = False
        self._tasks: set[asyncio.Task] = set()  # frames being received and handled
        self._pool_ids: dict[tuple, int] = {}  # pools this transport shares, by key
        self._mapped_by: set[tuple[PeerAddress, tuple]] = set()  # (peer, pool key) the peer maps

    @property
    def address(self) -> PeerAddress:
        return self._address

    async def map_device_pool(self, peer: PeerAddress, pool, timeout_s: float | None = None) -> bool:
        """Where the network maps pools and both ends allow it: the pool is registered (once)
        and ``peer`` reads its rows in place from here on. False otherwise."""
        self._require_open()
        receiver = self._network._listeners.get(peer)
        if receiver is None:
            raise PeerUnreachable(peer, "no listener")
        if not (self._network.maps_pools and self._config.device_pools and receiver._config.device_pools):
            return False
        key = pool_key(pool)
        if key not in self._pool_ids:
            self._pool_ids[key] = len(self._pool_ids)
            self._network._pools[(self._address, self._pool_ids[key])] = row_words(pool)
        self._mapped_by.add((peer, key))
        return True

    async def start(self, handler: MessageHandler, placer: BufferPlacer | None = None) -> None:
        self._handler = handler
        self._placer = placer
        self._network._listeners[self._address] = self

    async def request(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Message:
        self._require_open()
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = next(self._next_msg_id)
        frame = self._encode(message, msg_id, device_ready=device_ready,  # raises before anything waits on it
                             place_rows=self._placer_of_rows(peer))
        future = asyncio.get_running_loop().create_future()
        timer_id = self._network.clock.call_later(
            timeout_s, lambda: self._time_out(msg_id, timeout_s))
        self._pending[msg_id] = _PendingRequest(future, timer_id, peer, message.TYPE)
        if not self._network._post(self, peer, frame, message, msg_id, None):
            self._finish(msg_id, PeerUnreachable(peer, "no listener"))
        return await future

    def request_soon(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Awaitable[Message]:
        """``request`` as a task: in memory a message travels only when the loop runs anyway."""
        return asyncio.ensure_future(self.request(peer, message, timeout_s=timeout_s, device_ready=device_ready))

    async def send(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> None:
        self._require_open()
        msg_id = next(self._next_msg_id)
        frame = self._encode(message, msg_id, wants_reply=False)
        if not self._network._post(self, peer, frame, message, msg_id, None):
            raise PeerUnreachable(peer, "no listener")

    def shared_host_buffer(self, nbytes: int) -> None:
        """None: in memory every buffer is copied straight into its destination already."""
        return None

    def shared_memory_status(self) -> dict:
        return {"region": None, "committed_bytes": 0, "in_use_bytes": 0, "peers": [],
                "header_ring_peers": [], "header_ring_inbound": 0}

    async def connect(self, peer: PeerAddress) -> None:
        self._require_open()
        if peer not in self._network._listeners:
            raise PeerUnreachable(peer, "no listener")

    async def close(self) -> None:
        registered = False
        for registry in (self._network._listeners, self._network._transports):
            if registry.get(self._address) is self:
                del registry[self._address]
                registered = True
        self._closed = True  # first: a handler still running answers nothing
        self._network._forget_pools(self._address)
        self._fail_all(PeerUnreachable(self._address, "transport closed"))
        if registered:  # as UCX drops the connections of a closed listener: requests to it fail
            self._network._fail_requests_to(self._address, PeerUnreachable(self._address, "connection closed"))
        self._cancel_tasks()  # as UCX's close

    # --- internals ---

    def _require_open(self) -> None:
        if self._closed:
            raise PeerUnreachable(self._address, "transport closed")

    def _placer_of_rows(self, peer: PeerAddress) -> Callable[[PoolRows], int | None] | None:
        if not self._mapped_by:
            return None

        def place(rows: PoolRows) -> int | None:
            key = pool_key(rows.pool)
            return self._pool_ids[key] if (peer, key) in self._mapped_by else None
        return place

    def _encode(self, message: Message, msg_id: int, *, reply_to: int | None = None,
                wants_reply: bool = True, device_ready: bool = False,
                place_rows: Callable[[PoolRows], int | None] | None = None) -> codec.EncodedFrame:
        limits = self._config.limits
        return codec.encode(message, msg_id, reply_to=reply_to, wants_reply=wants_reply,
                            device_ready=device_ready, place_rows=place_rows,
                            inline_limit_bytes=limits.inline_limit_bytes,
                            inline_cuda_limit_bytes=limits.inline_cuda_limit_bytes,
                            max_header_bytes=limits.max_header_bytes)

    def _cancel_tasks(self) -> None:
        """Cancel the handlers still running, but not the one calling (a handler that closes
        its own transport finishes its own step)."""
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                task.cancel()

    async def _receive(self, sender: InMemoryTransport, frame: codec.EncodedFrame) -> None:
        """A frame on the listener's side (a request or a one-way message) from ``sender``."""
        try:
            header = codec.decode_header(frame.header, self._config.limits)
        except ProtocolError as e:
            self._refuse(sender, e, codec.request_id_of(frame.header))
            return
        try:
            if header.reply_to is not None:
                raise ProtocolError(ErrorCode.INVALID_FIELDS, "a reply on a request path")
            destinations = self._placer(header.message) if self._placer else None
            message = _carry(header, frame, destinations, self._config,
                             lambda pool_id: self._network._pools.get((sender.address, pool_id)))
        except ProtocolError as e:  # as UCX refuses a frame whose buffers disagree with it
            self._refuse(sender, e, header.msg_id if header.reply_to is None else None)
            return
        except (PlacementRefused, ValueError) as e:
            reply: Message = ErrorReply(ErrorCode.PLACEMENT_REFUSED, str(e))
        else:
            reply = await self._serve(message)
        if header.wants_reply and not self._closed:  # a closed or killed transport answers nothing
            try:
                reply_frame = self._encode(reply, next(self._next_msg_id), reply_to=header.msg_id,
                                           wants_reply=False)
            except Exception as e:  # noqa: BLE001  a handler's bad tensor: the requester hears why, as on UCX
                reply = codec.unencodable_reply(reply, e)
                reply_frame = self._encode(reply, next(self._next_msg_id), reply_to=header.msg_id,
                                           wants_reply=False)
            self._network._post(self, sender.address, reply_frame, reply, header.msg_id, header.msg_id,
                                requester=sender)

    def _refuse(self, sender: InMemoryTransport, error: ProtocolError, request_id: int | None) -> None:
        """As the UCX listener refuses a bad frame, then closes the connection: ``ErrorReply``
        answering the frame where its id could be read (``request_id``; its request fails with
        RemoteError, the sender's others here with PeerUnreachable), or answering none (all of
        them fail with RemoteError)."""
        refusal = ErrorReply(error.code, error.detail)
        msg_id = next(self._next_msg_id)
        frame = self._encode(refusal, msg_id, reply_to=request_id, wants_reply=False)
        self._network._post(self, sender.address, frame, refusal, msg_id, request_id, requester=sender)

    async def _serve(self, message: Message) -> Message:
        if self._handler is None:
            return ErrorReply(ErrorCode.NO_HANDLER, "transport not started")
        try:
            reply = self._handler(message)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as e:  # the handler's failure is the requester's to see
            return ErrorReply(ErrorCode.HANDLER_FAILED, f"{type(e).__name__}: {e}")
        if reply is None:
            return Ack()
        if type(reply) not in codec.MESSAGE_CLASSES:  # as on UCX
            return ErrorReply(ErrorCode.HANDLER_FAILED,
                              f"TypeError: the handler returned a {type(reply).__name__}, not a message")
        return reply

    async def _take_replies(self, peer: PeerAddress, frame: codec.EncodedFrame) -> None:
        """A frame on the way back from ``peer``: a reply to one of this transport's requests,
        or the refusal of a frame sent there. As on UCX, where a refusal closes the connection
        and a reply that cannot be read drops it: a refusal fails its request with RemoteError
        and the others waiting on ``peer`` with PeerUnreachable (all with RemoteError where it
        answers none); a reply refused here fails them all with PeerUnreachable."""
        try:
            header = codec.decode_header(frame.header, self._config.limits)
            if header.reply_to is None:
                if isinstance(header.message, ErrorReply):  # the peer refused a frame, it knew not whose
                    self._fail_requests_to(peer, RemoteError(peer, header.message.code, header.message.detail))
                    return
                raise ProtocolError(ErrorCode.INVALID_FIELDS, "a request on a reply path")
            pending = self._pending.get(header.reply_to)
            reply = _carry(header, frame, None, self._config, _no_pool) if pending is not None and pending.peer == peer else None
        except ProtocolError as e:
            self._fail_requests_to(peer, PeerUnreachable(peer, f"a reply could not be read: {e}"))
            return
        except Exception as e:  # noqa: BLE001  a bug, or no memory for the reply
            self._fail_requests_to(peer, PeerUnreachable(peer, f"reading replies failed: {e!r}"))
            return
        if reply is not None:  # else the request timed out already
            if isinstance(reply, ErrorReply):
                self._finish(header.reply_to, RemoteError(peer, reply.code, reply.detail))
            else:
                self._finish(header.reply_to, reply)
        message = header.message
        if type(message) is ErrorReply and message.code in codec.REFUSAL_CODES:
            # The peer refused that request's frame and closed the connection: the others fail.
            self._fail_requests_to(peer, PeerUnreachable(
                peer, f"the peer refused a frame ({message.code.value}: {message.detail}) "
                      "and closes the connection"))

    def _time_out(self, msg_id: int, timeout_s: float) -> None:
        pending = self._pending.get(msg_id)
        if pending is not None:
            self._finish(msg_id, RequestTimeout(pending.peer, pending.message_type, timeout_s))

    def _finish(self, msg_id: int, outcome: Message | Exception) -> None:
        pending = self._pending.pop(msg_id)
        self._network.clock.cancel(pending.timer_id)
        if pending.future.done():
            return
        if isinstance(outcome, Exception):
            pending.future.set_exception(outcome)
        else:
            pending.future.set_result(outcome)

    def _fail_requests_to(self, peer: PeerAddress, error: Exception) -> None:
        for msg_id in [m for m, p in self._pending.items() if p.peer == peer]:
            self._finish(msg_id, error)

    def _fail_all(self, error: Exception) -> None:
        for msg_id in list(self._pending):
            self._finish(msg_id, error)


def _carry(header: codec.FrameHeader, frame: codec.EncodedFrame, destinations: list | None,
           config: TransportConfig, pool_of: Callable[[int], object]) -> Message:
    """Move a frame's buffers into their destinations, as the wire would; rows of the
    sender's pools copied out of them (``pool_of``: a pool id's row bytes, None if unknown),
    refused as the UCX receiver refuses them."""
    if destinations is None:
        device = config.landing_device(all(header.inline))
        destinations = [allocate(spec, device) for spec in header.specs]
    for dest, src in zip(codec.land_inline(header, destinations), frame.buffers, strict=True):
        copy_bytes(dest, src)
    pulls = codec.pool_row_destinations(header, destinations) if header.pool_rows else []
    sources = [pool_of(pool_id) for _dest, pool_id, _rows in pulls]
    for source, (dest, pool_id, rows) in zip(sources, pulls):  # all before any copy
        check_rows(source, pool_id, rows, dest.nbytes)
    for source, (dest, _pool_id, rows) in zip(sources, pulls):
        pull_rows(source, rows, dest)
    return codec.assemble(header, destinations)


def _no_pool(_pool_id: int) -> None:
    return None  # replies name no pools


