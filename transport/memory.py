"""An in-memory transport with the UCX transport's interface, on a fake clock.

Every message goes through the real codec (encode, header checks, placement, byte copy,
assemble), so tests above the transport see exactly what UCX would deliver. Delivery is FIFO
on the event loop; time moves only with ``FakeClock.tick``, so timeouts are deterministic.
The network records a trace of every frame and can kill or silence an instance:

- ``kill(address)``: what UCX shows for a SIGKILLed peer: requests waiting on it fail with
  PeerUnreachable at once, and so do new ones until a transport starts at that address again.
- ``silence(address)``: frames to and from it vanish; requests time out on the fake clock,
  as with a hung peer, which only the daemons' heartbeats notice.
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
    outcome: str  # "delivered" | "dropped" (silenced) | "unreachable" (no listener)


@dataclass
class _PendingRequest:
    future: asyncio.Future
    timer_id: int
    peer: PeerAddress
    message_type: str


class InMemoryNetwork:
    """Connects in-memory transports by address."""

    def __init__(self, clock: FakeClock | None = None) -> None:
        self.clock = clock or FakeClock()
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
        self._listeners.pop(address, None)
        transport = self._transports.pop(address, None)
        if transport is not None:
            transport._fail_all(PeerUnreachable(address, "killed"))
            transport._closed = True
        # Every live transport, serving or only requesting: its requests to the killed one break.
        for other in list(self._transports.values()) + list(self._listeners.values()):
            other._fail_requests_to(address, PeerUnreachable(address, "connection reset"))

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

    def _post(self, src: PeerAddress, dst: PeerAddress, frame: codec.EncodedFrame,
              message: Message, msg_id: int, reply_to: int | None) -> bool:
        """Queue a frame; False when nothing listens at ``dst``."""
        def event(outcome: str) -> None:
            self.trace.append(TraceEvent(self.clock.now(), src, dst, message.TYPE, msg_id,
                                         reply_to, outcome))

        if src in self._silenced or dst in self._silenced:
            event("dropped")
            return True
        receiver = self._listeners.get(dst) if reply_to is None else self._transports.get(dst)
        if receiver is None:
            event("unreachable")
            return False
        event("delivered")
        self._in_flight += 1
        asyncio.get_running_loop().call_soon(self._deliver, receiver, src, frame)
        return True

    def _deliver(self, receiver: InMemoryTransport, src: PeerAddress,
                 frame: codec.EncodedFrame) -> None:
        if receiver._closed:  # killed or closed since the frame was queued: no handler runs
            self._in_flight -= 1
            return
        task = asyncio.get_running_loop().create_task(receiver._receive(src, frame))
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

    @property
    def address(self) -> PeerAddress:
        return self._address

    async def start(self, handler: MessageHandler, placer: BufferPlacer | None = None) -> None:
        self._handler = handler
        self._placer = placer
        self._network._listeners[self._address] = self

    async def request(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> Message:
        self._require_open()
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = next(self._next_msg_id)
        future = asyncio.get_running_loop().create_future()
        timer_id = self._network.clock.call_later(
            timeout_s, lambda: self._time_out(msg_id, timeout_s))
        self._pending[msg_id] = _PendingRequest(future, timer_id, peer, message.TYPE)
        frame = codec.encode(message, msg_id, inline_limit_bytes=self._config.limits.inline_limit_bytes,
                             inline_cuda_limit_bytes=self._config.limits.inline_cuda_limit_bytes)
        if not self._network._post(self._address, peer, frame, message, msg_id, None):
            self._finish(msg_id, PeerUnreachable(peer, "no listener"))
        return await future

    def request_soon(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> Awaitable[Message]:
        """``request`` as a task: in memory a message travels only when the loop runs anyway."""
        return asyncio.ensure_future(self.request(peer, message, timeout_s=timeout_s))

    async def send(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> None:
        self._require_open()
        msg_id = next(self._next_msg_id)
        frame = codec.encode(message, msg_id, wants_reply=False,
                             inline_limit_bytes=self._config.limits.inline_limit_bytes,
                             inline_cuda_limit_bytes=self._config.limits.inline_cuda_limit_bytes)
        if not self._network._post(self._address, peer, frame, message, msg_id, None):
            raise PeerUnreachable(peer, "no listener")

    def shared_host_buffer(self, nbytes: int) -> None:
        """None: in memory every buffer is copied straight into its destination already."""
        return None

    def shared_memory_status(self) -> dict:
        return {"region": None, "committed_bytes": 0, "in_use_bytes": 0, "peers": []}

    async def connect(self, peer: PeerAddress) -> None:
        self._require_open()
        if peer not in self._network._listeners:
            raise PeerUnreachable(peer, "no listener")

    async def close(self) -> None:
        for registry in (self._network._listeners, self._network._transports):
            if registry.get(self._address) is self:
                del registry[self._address]
        self._fail_all(PeerUnreachable(self._address, "transport closed"))
        self._closed = True

    # --- internals ---

    def _require_open(self) -> None:
        if self._closed:
            raise PeerUnreachable(self._address, "transport closed")

    async def _receive(self, src: PeerAddress, frame: codec.EncodedFrame) -> None:
        try:
            header = codec.decode_header(frame.header, self._config.limits)
        except ProtocolError as e:  # only a bug in the sender's codec gets here
            raise AssertionError(f"in-memory frame refused: {e}") from e
        if header.reply_to is not None:
            self._take_reply(header, frame)
            return
        try:
            destinations = self._placer(header.message) if self._placer else None
            message = _carry(header, frame, destinations, self._config)
        except ProtocolError as e:  # as UCX refuses a frame whose buffers disagree with it
            reply: Message = ErrorReply(e.code, e.detail)
        except (PlacementRefused, ValueError) as e:
            reply = ErrorReply(ErrorCode.PLACEMENT_REFUSED, str(e))
        else:
            reply = await self._serve(message)
        if header.wants_reply:
            try:
                reply_frame = codec.encode(reply, next(self._next_msg_id), reply_to=header.msg_id,
                                           wants_reply=False)
            except Exception as e:  # noqa: BLE001  a handler's bad tensor: the requester hears why, as on UCX
                reply = codec.unencodable_reply(reply, e)
                reply_frame = codec.encode(reply, next(self._next_msg_id), reply_to=header.msg_id,
                                           wants_reply=False)
            self._network._post(self._address, src, reply_frame, reply,
                                header.msg_id, header.msg_id)

    async def _serve(self, message: Message) -> Message:
        if self._handler is None:
            return ErrorReply(ErrorCode.NO_HANDLER, "transport not started")
        try:
            reply = self._handler(message)
            if inspect.isawaitable(reply):
                reply = await reply
        except Exception as e:  # the handler's failure is the requester's to see
            return ErrorReply(ErrorCode.HANDLER_FAILED, f"{type(e).__name__}: {e}")
        return Ack() if reply is None else reply

    def _take_reply(self, header: codec.FrameHeader, frame: codec.EncodedFrame) -> None:
        pending = self._pending.get(header.reply_to)
        if pending is None:
            return  # the request timed out already
        reply = _carry(header, frame, None, self._config)
        if isinstance(reply, ErrorReply):
            self._finish(header.reply_to, RemoteError(pending.peer, reply.code, reply.detail))
        else:
            self._finish(header.reply_to, reply)

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


def _carry(header: codec.FrameHeader, frame: codec.EncodedFrame,
           destinations: list | None, config: TransportConfig) -> Message:
    """Move a frame's buffers into their destinations, as the wire would."""
    if destinations is None:
        device = config.landing_device(all(header.inline))
        destinations = [allocate(spec, device) for spec in header.specs]
    for dest, src in zip(codec.land_inline(header, destinations), frame.buffers, strict=True):
        copy_bytes(dest, src)
    return codec.assemble(header, destinations)
