"""Messages between instances over UCX, through ``ucxx``.

One listener per transport. Requests go over an outbound connection per peer, cached and made
again on the next request after it fails (a peer that restarted is reached afresh); replies come
back on the same connection. Incoming connections are served by the listener: a handler that
answers at once (a plain function) is answered inline; one that returns an awaitable runs in a
task of its own, so a slow request never blocks the ones behind it.

Wire: on one UCX endpoint, each frame is one tag message with the header (see ``codec``) on the
connection's tag, then one tag message per buffer that is not inline, on a tag of that frame's
own (``buffer_tag``: the connection's tag, the frame's id and whether it is a reply, with the
high bit flipped). UCX matches messages of one tag in order, so a header is never taken for a
buffer, nor one frame's buffers for another's: a frame whose buffers do not come is refused
after the frame timeout, and the frames behind it are served meanwhile. The sender posts a
frame's messages back to back (no await in between); the receiver, having decoded a header,
posts that frame's buffer receives and goes on to the next header.
Buffers are received straight into their destinations (``BufferPlacer``), host or device;
UCX picks the path (TCP, CUDA IPC, NVLink, InfiniBand) from ``UCX_TLS``. Between processes of
one host, a request's host buffers go through the sender's shared-memory region instead
(``shared_memory``; offered on each new connection, the receiver copies them out): UCX would
carry them over TCP loopback. A move's KV blocks from a device pool that the peer mapped
(``device_pools``; offered before the connection's first move) travel as their row ids, and
the receiver copies them straight out of the sender's pool: no gather, no bytes through UCX.
Requests are awaited through ``UcxProgress`` (spin briefly, then sleep on the worker's event
fd): ucxx's own await busy-loops the event loop while a receive is posted, which is always.

A tag receive reports a message longer than its buffer (refused as an oversized frame) but not
a shorter one, so the header buffer is zeroed after each frame: a frame shorter than its
preamble announces decodes as zeros and is refused.

Failures: a peer that dies is noticed by UCX within milliseconds (the pending receive fails);
every request waiting on it fails with PeerUnreachable. Every await is bounded: connecting by
``connect_timeout_s``, a request by its timeout, a frame's sends and buffer receives by
``frame_timeout_s``, an idle connection by ``idle_timeout_s`` (then closed). A silent but live
peer shows as RequestTimeout; the daemons' heartbeats decide when it is dead.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field

import numpy as np
import torch
import ucxx
from ucxx._lib.arr import Array
from ucxx.exceptions import UCXCloseError, UCXError, UCXMessageTruncatedError
from ucxx.types import Tag, TagMaskFull

from infinite_llm.transport import codec, header_ring, wire_trace
from infinite_llm.transport.device_pools import (
    DevicePoolUnavailable,
    PoolRows,
    PullGraphs,
    PullSlots,
    SharedPools,
    check_rows,
    export_pool,
    open_pool,
    pool_key,
    pull_rows,
    row_words,
)
from infinite_llm.transport.errors import (
    PeerUnreachable,
    PlacementRefused,
    ProtocolError,
    RemoteError,
    RequestTimeout,
)
from infinite_llm.transport.header_ring import HeaderRing, HeaderRingUnavailable, PeerHeaderRing, RingBroken
from infinite_llm.transport.interface import (
    BufferPlacer,
    MessageHandler,
    PeerAddress,
    TransportConfig,
)
from infinite_llm.transport.messages import (
    Ack,
    DevicePoolOffer,
    ErrorCode,
    ErrorReply,
    HeaderRingAccepted,
    HeaderRingOffer,
    HeaderRingOpened,
    Message,
    SharedMemoryOffer,
)
from infinite_llm.transport.shared_memory import (
    ParallelCopy,
    PeerRegion,
    SharedMemoryUnavailable,
    SharedRegion,
    default_copy_threads,
    remove_stale_regions,
)
from infinite_llm.transport.tensors import allocate, nbytes_of
from infinite_llm.transport.ucx_progress import UcxProgress

log = logging.getLogger(__name__)


class ConnectionBroken(Exception):
    """The connection can carry no more frames; it is closed."""


_TAG_BITS = (1 << 64) - 1
_TAG_HIGH_BIT = 1 << 63
_FRAME_BITS = _TAG_HIGH_BIT - 1


def buffer_tag(tag: int, msg_id: int, is_reply: bool) -> int:
    """The UCX tag of the buffers of frame ``msg_id`` on a connection whose headers travel on
    ``tag``: its high bit is the header tag's flipped, so no header matches a buffer receive;
    the frame's id and direction (a reply's ids come from the other side's counter) make it the
    frame's own. Ids wrap at 2**62 (a connection never has that many frames in flight)."""
    return (tag ^ _TAG_HIGH_BIT ^ (((msg_id << 1) | is_reply) & _FRAME_BITS)) & _TAG_BITS


@dataclass(eq=False)  # identity: connections live in sets
class _Connection:
    """One UCX endpoint and what rides on it."""

    endpoint: ucxx._lib_async.Endpoint
    label: str  # peer, for errors and logs
    config: TransportConfig
    progress: UcxProgress
    header_buffer: np.ndarray = field(init=False)
    pending: dict[int, asyncio.Future] = field(default_factory=dict)  # msg_id -> reply
    broken: bool = False
    # Frames posted but not yet sent (replies, and requests whose wait ended first), with their
    # UCX requests and the time.monotonic() by which they must be: a frame owns the memory UCX
    # reads, so it is kept until then. Looked at when a frame is posted or one arrives, instead
    # of a task awaiting each one (a task per reply cost more than a small reply's round trip
    # has to spare).
    unsent: list[tuple[list, codec.EncodedFrame, float]] = field(default_factory=list)
    # Outbound, where the peer opened this process's region: requests' host buffers go there.
    # What each request (by msg_id) has there is kept until its reply comes (the peer copied it
    # out before it answered), or a frame timeout after the connection broke: the slots copied
    # into (offsets, freed then) and the buffers that lay in the region already (kept alive, so
    # that their slots are not used again while the peer may read them).
    shared_out: SharedRegion | None = None
    shared_slots: dict[int, list] = field(default_factory=dict)
    new_slots: list = field(default_factory=list)  # of the frame being encoded
    # Inbound, where the peer's region is open: its requests' buffers are read from there.
    shared_in: PeerRegion | None = None
    # Frames whose buffers are landing in tasks (``lands_in_background``).
    receiving: int = 0
    # Handlers of this connection's requests running as tasks (their replies still to come).
    handling: int = 0
    # Headers to a local peer go through a ring in shared memory (``header_ring``) once the
    # peer opened it, and the peer's come through its own: ``ring_out`` is this side's,
    # ``ring_in`` the peer's. A listener's ring waits in ``ring_offered`` until the requester
    # says it opened it. Headers that do not fit a ring go over UCX as before.
    ring_out: HeaderRing | None = None
    ring_in: PeerHeaderRing | None = None
    ring_offered: HeaderRing | None = None
    # The header receive posted on the endpoint; it stays posted while headers come through
    # the ring, and a killed peer fails it.
    header_request: object | None = None
    ring_headers: int = 0  # headers taken from ring_in
    # Headers sent over UCX on this connection, and received over it: a ring record carries
    # its producer's count, and is taken only once as many have come (header_ring).
    ucx_headers_sent: int = 0
    ucx_headers_taken: int = 0
    # Frames posted on this connection, either way: a connection that only sends (one-way
    # messages, no replies to read) is not idle while it does.
    frames_posted: int = 0
    # Outbound: the device pools the peer mapped (``map_device_pool``), by the pool's key, with
    # the id frames name them by; each pool's offer while it is under way; the pools it would
    # not map. Inbound: the peer's pools mapped here, by id, as ``[num_rows, words]``
    # bytes, and the stream their rows are copied out on.
    pools_out: SharedPools = field(default_factory=SharedPools)
    pool_offers: dict[tuple, asyncio.Future] = field(default_factory=dict)
    pools_declined: SharedPools = field(default_factory=SharedPools)
    pools_in: dict[int, torch.Tensor] = field(default_factory=dict)
    pool_handles_in: dict[int, str] = field(default_factory=dict)
    pull_stream: object | None = None
    pull_slots: PullSlots | None = None
    pull_graphs: PullGraphs | None = None  # captured pulls into this process's pools

    def __post_init__(self) -> None:
        self.header_buffer = np.zeros(self.config.limits.max_header_bytes, dtype=np.uint8)
        self._header_array = Array(self.header_buffer)  # made once: every header lands here
        # The tags ucxx agreed with the peer when it connected (its Endpoint.send/recv use the
        # same); requests are posted on the UCX endpoint directly and awaited through
        # UcxProgress, since ucxx's own await busy-loops the event loop.
        self._ucx_endpoint = self.endpoint._ep
        self._send_tag_value = self.endpoint._tags["msg_send"]
        self._recv_tag_value = self.endpoint._tags["msg_recv"]
        self._send_tag = Tag(self._send_tag_value)
        self._recv_tag = Tag(self._recv_tag_value)

    def place_shared(self, array: object) -> int | None:
        """Where a request's host buffer lies in the region: as it is, if it is there already,
        else copied into a new slot; None where the region is full (the buffer goes over UCX)."""
        region = self.shared_out
        offset = region.offset_of(array)
        if offset is not None:
            self.new_slots.append(array)  # lent as it lies: alive until the peer has read it
            return offset
        offset = region.copy_in(array)
        if offset is not None:
            self.new_slots.append(offset)
        return offset

    def place_rows(self, rows: PoolRows) -> int | None:
        """The id under which the peer mapped ``rows``' pool, None where it did not."""
        return self.pools_out.get(rows.pool)

    def claim_slots(self, msg_id: int) -> None:
        """The slots of the frame just encoded belong to request ``msg_id``."""
        if self.new_slots:
            self.shared_slots[msg_id] = self.new_slots
            self.new_slots = []

    def free_new_slots(self) -> None:
        _free_slots(self.shared_out, self.new_slots)
        self.new_slots = []

    def free_slots(self, msg_id: int) -> None:
        _free_slots(self.shared_out, self.shared_slots.pop(msg_id, ()))

    def release_slots_after(self, msg_id: int, deadline: float) -> None:
        """The slots of request ``msg_id``, which ended with no reply that freed them: the peer
        copies nothing out of them after ``deadline`` (time.monotonic(), the frame's ``su``),
        so they are freed a little after it."""
        slots = self.shared_slots.pop(msg_id, None)
        if slots:
            delay = max(0.0, deadline - time.monotonic()) + SHARED_SLOTS_GRACE_S
            asyncio.get_running_loop().call_later(delay, _free_slots, self.shared_out, slots)

    def _check_open(self) -> None:
        if self.broken or self.endpoint.closed:
            raise UCXCloseError(f"{self.label}: endpoint closed")
        self._ucx_endpoint.raise_on_error()

    def _post_send(self, buffer, tag: Tag):
        return self._ucx_endpoint.tag_send(Array(buffer), tag)

    def _post_recv(self, array: Array, tag: Tag):
        return self._ucx_endpoint.tag_recv(array, tag, TagMaskFull)

    def post_frame(self, frame: codec.EncodedFrame, msg_id: int, is_reply: bool) -> list:
        """Post one frame's messages (``msg_id``: the id its header carries; ``is_reply``: it
        answers a request); returns their UCX requests (small frames are often sent already).
        Raises ConnectionBroken if the connection is gone."""
        # A frame's messages are posted back to back, with no await in between: no lock is
        # needed and several frames can be in flight on one connection. Its buffers go on a
        # tag of the frame's own (``buffer_tag``), where the receiver looks for them.
        if self.broken:
            raise ConnectionBroken(f"{self.label}: connection closed")
        self.frames_posted += 1
        try:
            self._check_open()
            ring = self.ring_out
            if ring is not None and ring.write(frame.header, self.ucx_headers_sent):
                requests = []  # the header is in the peer's ring already
            else:
                # A numpy view, not the bytes object: posting a fresh bytes object takes ucxx
                # ~0.4 ms (measured on loopback), a view of the same memory a few microseconds.
                requests = [self._post_send(np.frombuffer(frame.header, dtype=np.uint8), self._send_tag)]
                self.ucx_headers_sent += 1
            if frame.buffers:
                tag = Tag(buffer_tag(self._send_tag_value, msg_id, is_reply))
                requests.extend(self._post_send(b, tag) for b in frame.buffers)
        except (UCXError, RingBroken) as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: send failed: {e!r}") from e
        return requests

    async def wait_sent(self, requests: list, deadline: float | None = None) -> None:
        """Until every request of a posted frame completed, by ``deadline`` (time.monotonic(),
        None: the frame timeout). A failed send, or one past the frame timeout, breaks the
        connection. A caller that stops waiting first (its own deadline: TimeoutError, or
        cancelled) leaves the frame to UCX: its messages are all posted, so it goes whole; the
        caller keeps its memory until it went (``keep_until_sent``). Breaking the connection
        then would fail every other request on it."""
        frame_deadline = time.monotonic() + self.config.frame_timeout_s
        wait_deadline = frame_deadline if deadline is None else min(deadline, frame_deadline)
        try:
            for request in requests:
                await self.progress.wait(request, wait_deadline)
        except UCXError as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: send failed: {e!r}") from e
        except TimeoutError as e:
            if wait_deadline >= frame_deadline:
                self.abort()
                raise ConnectionBroken(f"{self.label}: send failed: {e!r}") from e
            raise

    def keep_until_sent(self, requests: list, frame: codec.EncodedFrame) -> None:
        """Keep a posted frame until UCX has sent it (and look at those kept before)."""
        self.sweep_unsent()
        self.unsent.append((requests, frame, time.monotonic() + self.config.frame_timeout_s))

    def sweep_unsent(self) -> None:
        """Drop the kept frames that UCX has sent. A failed send, or one past the frame
        timeout, breaks the connection, as awaiting it would (``wait_sent``)."""
        if not self.unsent:
            return
        now = time.monotonic()
        still = []
        for entry in self.unsent:
            requests, _frame, deadline = entry
            if all(r.completed for r in requests):  # UCX reads it no more, sent or not
                try:
                    for request in requests:
                        request.check_error()
                except UCXError as e:
                    if not self.broken:
                        log.warning("%s: a frame was not sent: %r", self.label, e)
                        self.abort()
                continue
            if now >= deadline and not self.broken:
                log.warning("%s: a frame not sent within the frame timeout", self.label)
                self.abort()
            still.append(entry)  # until UCX is done with it (an abort cancels it)
        self.unsent = still

    async def send_frame(self, frame: codec.EncodedFrame, msg_id: int, is_reply: bool,
                         deadline: float | None = None) -> None:
        """Send one frame whole (see ``post_frame`` and ``wait_sent``)."""
        requests = self.post_frame(frame, msg_id, is_reply)
        try:
            await self.wait_sent(requests, deadline)
        except (TimeoutError, asyncio.CancelledError):
            self.keep_until_sent(requests, frame)  # the caller gave up: UCX may still read it
            raise

    def busy(self) -> bool:
        """Whether work is in flight on this connection: requests awaiting replies, frames
        landing, handlers running. It is not idle then, whatever the time since its last frame."""
        return bool(self.pending) or self.receiving > 0 or self.handling > 0

    async def recv_header(self, timeout_s: float) -> codec.FrameHeader:
        """The next frame's header, from the peer's ring or over UCX. Raises ProtocolError for
        a bad frame, ConnectionBroken when the peer is gone or the connection idles (``busy``
        is False, and no frame was posted on it meanwhile) past ``timeout_s``."""
        buf = self.header_buffer
        try:
            ring = self.ring_in
            request = self.header_request
            deadline = time.monotonic() + timeout_s
            posted = self.frames_posted
            while True:
                if request is None:
                    # Kept posted while headers come through the ring, so that one sent over
                    # UCX (too large for the ring, or the ring full) is received at once.
                    try:
                        self._check_open()
                        request = self.header_request = self._post_recv(self._header_array, self._recv_tag)
                    except UCXError:
                        if ring is None or not ring.has_frame():
                            raise
                        # The ring's last headers first; this error again after them.
                failed = request is None or (request.completed and not _succeeded(request))
                if ring is not None:
                    # In the order they were sent: a record waits for the UCX headers sent
                    # before it. Once the endpoint has failed, whatever the ring holds (a peer
                    # that closes right after its last header, a refusal, has it read).
                    data = ring.take(None if failed else self.ucx_headers_taken)
                    if data is not None:
                        self.ring_headers += 1
                        if self.ring_headers % RING_HEADERS_PER_PROGRESS == 0:
                            # While the ring never empties, nothing else here progresses UCX:
                            # a header sent over it meanwhile would wait for the 10 ms tick.
                            self.progress.poke()
                        self.sweep_unsent()
                        return self._decode(data)
                if request is None:
                    continue  # the endpoint failed with headers still in the ring: read on
                if request.completed:
                    break
                try:
                    # A record that waits for a UCX header: only that header can move things.
                    await self.progress.wait(request, deadline, None if ring is None or ring.waits_for_ucx else ring)
                except TimeoutError:
                    if not self.busy() and self.frames_posted == posted:
                        raise
                    # A long handler, reply or landing, or frames sent meanwhile: the same
                    # receive waits on.
                    deadline = time.monotonic() + timeout_s
                    posted = self.frames_posted
                except UCXError:
                    if ring is None:
                        raise
                    # Raised below, once the ring has been looked at again.
            self.header_request = None
            request.check_error()
            self.ucx_headers_taken += 1
        except UCXMessageTruncatedError:
            raise ProtocolError(ErrorCode.OVERSIZED_FRAME,
                                f"header over {buf.nbytes} bytes") from None
        except (UCXError, TimeoutError) as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: receive failed: {e!r}") from e
        self.sweep_unsent()  # frames kept until sent are looked at with each frame that comes
        length = codec.frame_length(buf[:codec.PREAMBLE.size])
        if length > buf.nbytes:
            raise ProtocolError(ErrorCode.OVERSIZED_FRAME, f"header of {length} bytes announced")
        data = buf[:length].tobytes()
        buf[:max(length, codec.PREAMBLE.size)] = 0
        return self._decode(data)

    def _decode(self, data: bytes) -> codec.FrameHeader:
        try:
            return codec.decode_header(data, self.config.limits)
        except ProtocolError as e:
            e.msg_id = codec.request_id_of(data)  # the refusal answers it where it can be read
            raise

    def post_buffer_recvs(self, header: codec.FrameHeader, destinations: list) -> list:
        """Land the frame's inline buffers and post the receives of those that come over UCX;
        returns their UCX requests (``land_buffers`` waits for them). Once they are posted, the
        next frame's header may be received: the buffers come on the frame's own tag."""
        return self._post_recvs(header, codec.land_inline(header, destinations))

    def post_scratch_recvs(self, header: codec.FrameHeader) -> tuple[list, list]:
        """Post receives that drain a refused frame's buffers that come over UCX into one host
        scratch buffer (of the largest one; the bytes are dropped, so receives may share it):
        nothing for its inline buffers or those in the peer's shared memory, and host memory
        whatever the receiving device (UCX receives a CUDA sender's message into host memory).
        Returns the scratch views, to be kept until the receives ended (UCX writes into them),
        and the receives."""
        shared = header.shared_offsets
        pulled = header.pool_rows
        sizes = [spec.nbytes for i, (spec, inline) in enumerate(zip(header.specs, header.inline))
                 if not inline and spec.nbytes > 0 and (not shared or shared[i] < 0)
                 and (not pulled or pulled[i] is None)]
        if not sizes:
            return [], []
        scratch = np.empty(max(sizes), dtype=np.uint8)
        views = [scratch[:n] for n in sizes]
        return views, self._post_recvs(header, views)

    def _post_recvs(self, header: codec.FrameHeader, views: list) -> list:
        if not views:
            return []
        try:
            self._check_open()
            tag = Tag(buffer_tag(self._recv_tag_value, header.msg_id, header.reply_to is not None))
            return [self._post_recv(Array(v), tag) for v in views]
        except UCXError as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: receive failed: {e!r}") from e

    async def land_buffers(self, header: codec.FrameHeader, destinations: list, requests: list,
                           land_shared: bool = True) -> None:
        """The rest of a frame's receive after ``post_buffer_recvs``: its buffers in the peer's
        shared memory copied out (unless ``land_shared`` is False: a refused frame has nothing of
        them to drain), its rows of the peer's mapped pools copied out (nor those), and its UCX
        ``requests`` complete, within the frame timeout."""
        if header.shared_offsets and land_shared:
            await self._copy_shared(codec.shared_destinations(header, destinations), header.shared_until_ns)
        if header.pool_rows and land_shared:
            await self._pull_rows(codec.pool_row_destinations(header, destinations))
        if not requests:
            return
        try:
            deadline = time.monotonic() + self.config.frame_timeout_s
            for request in requests:
                await self.progress.wait(request, deadline)
        except UCXMessageTruncatedError:
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH, "a buffer over its length") from None
        except TimeoutError:
            # The buffers did not come (a sender that posted a header alone, or one too slow):
            # the frame is refused, and its receives end with the connection.
            raise ProtocolError(ErrorCode.TRUNCATED_FRAME,
                                f"buffers not received within {self.config.frame_timeout_s} s") from None
        except UCXError as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: receive failed: {e!r}") from e

    async def _pull_rows(self, pulls: list) -> None:
        """Copy a frame's rows out of the peer's mapped pools into their destinations, on this
        connection's pull stream, and wait for the copies with the event loop turning (within
        the frame timeout). Rows of a pool never mapped, past its end, or of another size than
        their destination are refused as a malformed frame. Rows that land in rows of a pool of
        this process go as one replay of a captured pull (``PullGraphs``), where one fits."""
        self._ensure_open()  # a frame landing while its connection aborts: not a malformed one
        sources = [self.pools_in.get(pool_id) for _destination, pool_id, _rows in pulls]
        for source, (destination, pool_id, rows) in zip(sources, pulls):  # all before any copy is queued
            check_rows(source, pool_id, rows, nbytes_of(destination))
        stream = self.pull_stream
        graphs = self.pull_graphs
        self.pull_slots.prune()
        with torch.cuda.stream(stream):
            graph = graphs.lend(sources, pulls) if graphs is not None else None
            if graph is not None:
                done = graph.event
                try:
                    graph.replay()
                except BaseException:  # what was queued keeps what it touches till it ran
                    graphs.retire(graph)
                    self.pull_slots.retire(graph, None)  # the graph holds what it touches
                    raise
            else:
                slot = self.pull_slots.take(sum(len(rows) for _destination, _pool_id, rows in pulls))
                done = slot.event
                try:
                    for source, (destination, _pool_id, rows) in zip(sources, pulls):
                        pull_rows(source, rows, destination, slot.index)
                except BaseException:  # what was queued keeps what it touches till it ran
                    slot.event.record(stream)
                    self.pull_slots.retire(slot, (sources, pulls))
                    raise
                slot.event.record(stream)
        wire_trace.record("in.pulls_queued")
        deadline = time.monotonic() + self.config.frame_timeout_s
        try:
            while not done.query():
                if time.monotonic() >= deadline:
                    raise ProtocolError(ErrorCode.TRUNCATED_FRAME,
                                        f"rows not copied within {self.config.frame_timeout_s} s")
                await asyncio.sleep(0)
        except BaseException:  # its copies may be queued still: what they touch is kept till they ran
            if graph is not None:
                graphs.retire(graph)
                self.pull_slots.retire(graph, None)  # the graph holds what it touches
            else:
                self.pull_slots.retire(slot, (sources, pulls))
            raise
        wire_trace.record("in.pulled")
        if graph is not None:
            graphs.give_back(graph)
        else:
            self.pull_slots.give_back(slot)
        self._ensure_open()

    def lands_in_background(self, requests: list, header: codec.FrameHeader) -> bool:
        """Whether a frame whose UCX receives are ``requests`` lands in a task rather than in the
        connection's loop, so that the frames behind it are not held up by its transfer; if so,
        it is counted until the task ends (``landed_in_background``). A frame with nothing to
        receive over UCX nor to copy out of a mapped pool lands in the loop (its copies run on
        this thread either way), and so does one beyond ``MAX_FRAMES_RECEIVING``: the bound
        keeps a peer from having more of its frames' buffers allocated at once."""
        if (requests or header.pool_rows) and self.receiving < MAX_FRAMES_RECEIVING:
            self.receiving += 1
            return True
        return False

    def landed_in_background(self) -> None:
        self.receiving -= 1

    def _ensure_open(self) -> None:
        """ConnectionBroken unless the connection is open: a peer whose connection broke may
        give the slots of its frames to others (a frame timeout later)."""
        try:
            self._check_open()
        except UCXError as e:
            self.abort()
            raise ConnectionBroken(f"{self.label}: connection closed: {e!r}") from e

    async def _copy_shared(self, shared: list[tuple[object, int, int]], until_ns: int) -> None:
        """Copy a frame's buffers out of the peer's region into their destinations; a large
        one on a thread (numpy lets go of the GIL), so the event loop turns meanwhile. The
        connection is checked before each copy and after the last: a frame whose connection
        broke meanwhile is dropped, never delivered (the sender frees its slots a frame timeout
        after the break, far longer than any one copy takes). So is the frame's time (its
        ``su``, ``until_ns``): a copy that ended after it may hold bytes of the slots' next use."""
        region = self.shared_in
        if region is None:
            raise ProtocolError(ErrorCode.INVALID_FIELDS, "a buffer in shared memory never offered")
        for view, offset, nbytes in shared:
            self._ensure_open()
            _ensure_in_time(until_ns)
            if nbytes >= _SHARED_COPY_ON_THREAD_BYTES:
                landed = await asyncio.get_running_loop().run_in_executor(
                    None, region.copy_to, view, offset, nbytes)
            else:
                landed = region.copy_to(view, offset, nbytes)
            if not landed:
                raise ProtocolError(ErrorCode.LENGTH_MISMATCH,
                                    f"{nbytes} bytes at {offset}: outside the shared region")
        self._ensure_open()
        _ensure_in_time(until_ns)

    def abort(self) -> None:
        if not self.broken:
            self.broken = True
            if self.shared_slots or self.new_slots:
                # The peer may be copying out of them still: free them once it cannot be.
                slots = [o for offsets in self.shared_slots.values() for o in offsets] + self.new_slots
                self.shared_slots, self.new_slots = {}, []
                asyncio.get_running_loop().call_later(
                    self.config.frame_timeout_s, _free_slots, self.shared_out, slots)
            if self.shared_in is not None:
                self.shared_in.close()
            for ring in (self.ring_in, self.ring_out, self.ring_offered):
                if ring is not None:
                    ring.close()
            # The peer's pools are unmapped with their last view; a pull still queued keeps
            # its own (``PullSlots.retire``). Offers under way fail with the pending requests.
            self.pools_in.clear()
            self.pull_graphs = None  # those lent to frames still landing go when they end
            self.endpoint.abort()
            # The aborted endpoint cancels it; let it go with the reader's wait rather than
            # with this connection, which may be collected only after UCX's worker at exit.
            self.header_request = None
            # The endpoint's requests end as cancelled; wake their waiters now rather than
            # at the next event on the worker.
            asyncio.get_running_loop().call_soon(self.progress.poke)

    def fail_pending(self, error: Exception) -> None:
        for future in self.pending.values():
            _fail(future, error)
        self.pending.clear()


class UcxTransport:
    """The UCX implementation of ``Transport``."""

    def __init__(self, config: TransportConfig | None = None) -> None:
        self._config = config or TransportConfig()
        # Where an all-inline frame lands is a setting: looked up once, not per frame.
        self._inline_lands_on_host = self._config.landing_device(True) == "cpu"
        self._handler: MessageHandler | None = None
        self._placer: BufferPlacer | None = None
        self._listener: ucxx._lib_async.Listener | None = None
        self._address: PeerAddress | None = None
        self._outbound: dict[PeerAddress, _Connection] = {}
        self._connecting: dict[PeerAddress, asyncio.Future] = {}  # connect attempts
        self._inbound: set[_Connection] = set()
        self._tasks: set[asyncio.Task] = set()
        self._next_msg_id = itertools.count(1)
        self._closed = False
        self._progress: UcxProgress | None = None
        self._shared_region: SharedRegion | None = None  # made on the first connection
        self._shared_region_failed = False
        self._shared_copy: ParallelCopy | None = None  # made with the first region, ours or a peer's
        self._offer_refused: set[PeerAddress] = set()  # peers that do not know SharedMemoryOffer
        self._pool_offer_refused: set[PeerAddress] = set()  # peers that do not know DevicePoolOffer
        self._pool_ids = itertools.count()
        self._exported = SharedPools()  # device pools shared: each one's offer, None where it cannot be
        self._pull_streams: dict[torch.device, tuple[object, PullSlots]] = {}
        self._ring_offer_refused: set[PeerAddress] = set()  # peers that do not know HeaderRingOffer

    @property
    def address(self) -> PeerAddress:
        if self._address is None:
            raise RuntimeError("transport not started")
        return self._address

    def shared_host_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 host tensor in this transport's shared memory: a request's buffer that
        lies in it goes to a peer on this host with no copy. Its memory is used again once no
        view of it is left. None where shared memory is off or full."""
        region = self._region()
        return None if region is None else region.host_buffer(nbytes)

    def shared_memory_status(self) -> dict:
        """This transport's shared memory: its region's file name (None: none made), bytes
        committed and in slots now, the peers that requests reach through it, and the
        connections whose headers go through header rings."""
        region = self._shared_region
        return {
            "region": None if region is None or region.closed else region.name,
            "committed_bytes": 0 if region is None else region.committed_bytes,
            "in_use_bytes": 0 if region is None else region.bytes_in_use,
            "peers": sorted(str(peer) for peer in self._outbound if self.uses_shared_memory(peer)),
            # Connections whose headers go through rings: to peers, by address, and from them.
            "header_ring_peers": sorted(str(peer) for peer, connection in self._outbound.items()
                                        if not connection.broken and connection.ring_out is not None),
            "header_ring_inbound": sum(1 for connection in self._inbound
                                       if not connection.broken and connection.ring_in is not None),
        }

    def uses_shared_memory(self, peer: PeerAddress) -> bool:
        """Whether requests to ``peer`` carry their host buffers through shared memory (the
        open connection's peer mapped this transport's region)."""
        connection = self._outbound.get(peer)
        return connection is not None and not connection.broken and connection.shared_out is not None

    async def map_device_pool(self, peer: PeerAddress, pool: torch.Tensor, timeout_s: float | None = None) -> bool:
        """Whether ``peer`` reads rows of ``pool`` (a contiguous device tensor of this process)
        in place, offering it on the connection first if it was not: the first call per
        connection and pool waits for the peer to map it, at most ``timeout_s`` (RequestTimeout
        after; the offer itself goes on, within the transport's ``request_timeout_s``, for the
        calls after). False where it cannot (another host, GPUs without peer access, memory CUDA
        does not share, turned off): rows then travel gathered. Raises as ``request`` does where
        the peer cannot be reached."""
        if not self._config.device_pools or not pool.is_cuda or peer in self._pool_offer_refused:
            return False
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        connection, deadline = await self._connection_for(peer, DevicePoolOffer.TYPE, timeout_s)
        if pool in connection.pools_out:
            return True
        if pool in connection.pools_declined:
            return False
        key = pool_key(pool)
        offer = connection.pool_offers.get(key)
        if offer is None:
            # The offer runs under the transport's own timeout, not the first caller's: callers
            # share it, and each waits for it no longer than its own deadline (nor than the
            # transport's). A connection dropped (close() drops them all) ends it at once.
            offer = connection.pool_offers[key] = asyncio.get_running_loop().create_task(self._offer_device_pool(
                peer, connection, pool, time.monotonic() + self._config.request_timeout_s,
                self._config.request_timeout_s))
            offer.add_done_callback(functools.partial(_offer_done, connection.pool_offers, key))
        try:
            return await asyncio.wait_for(asyncio.shield(offer), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            raise RequestTimeout(peer, DevicePoolOffer.TYPE, timeout_s) from None

    async def _offer_device_pool(self, peer: PeerAddress, connection: _Connection, pool: torch.Tensor,
                                 deadline: float, timeout_s: float) -> bool:
        if pool not in self._exported:
            try:
                self._exported.put(pool, export_pool(pool, next(self._pool_ids)))
            except DevicePoolUnavailable as e:
                log.warning("the device pool on %s is not shared with local peers (%s): its blocks travel "
                            "gathered", pool.device, e)
                self._exported.put(pool, None)
        offer = self._exported.get(pool)
        if offer is None:
            connection.pools_declined.put(pool, True)
            return False
        try:
            await self._exchange(peer, connection, self._encode_request(offer, connection, deadline=deadline),
                                 offer.TYPE, deadline, timeout_s)
        except RemoteError as e:
            log.info("%s does not map the device pool (%s): its blocks travel gathered", peer, e)
            if e.code == ErrorCode.UNKNOWN_TYPE:
                self._pool_offer_refused.add(peer)  # a peer that predates the offer closed the connection
            connection.pools_declined.put(pool, True)
            return False
        if connection.broken:
            return False
        connection.pools_out.put(pool, offer.pool_id)
        return True

    def set_spin(self, spin_s: float) -> None:
        """Change how long waits spin before they sleep, s. It holds for every transport of this
        event loop (they share one UCX worker and its waits)."""
        if spin_s < 0:
            raise ValueError(f"spin_s must be >= 0, got {spin_s}")
        if self._progress is None:
            raise RuntimeError("start the transport first")
        self._progress.spin_s = spin_s

    async def start(self, handler: MessageHandler, placer: BufferPlacer | None = None) -> None:
        self._progress = _progress_for_loop(self._config.spin_s)
        if self._config.shared_memory_bytes > 0:
            # Regions of processes that died without closing theirs (SIGKILL) hold tmpfs memory
            # until someone sweeps them: a transport that may make one sweeps when it starts.
            remove_stale_regions(self._config.shared_memory_dir)
        if self._rings_on():
            header_ring.remove_stale_rings(self._config.shared_memory_dir)
        if self._config.device_pools and self._config.receive_device.startswith("cuda") and torch.cuda.is_available():
            # Before any peer offers a pool: making a stream, pinned memory and an event waits for
            # the device's queued work, which on a first move would hold up the event loop.
            self._pull_streams_on(torch.device(self._config.receive_device))
        self._handler = handler
        self._placer = placer
        self._listener = ucxx.create_listener(self._serve_connection, port=self._config.port)
        self._address = PeerAddress(self._config.host, self._listener.port)

    async def request(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Message:
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        connection, deadline = await self._connection_for(peer, message.TYPE, timeout_s)
        frame = self._encode_request(message, connection, device_ready, deadline=deadline)
        return await self._exchange(peer, connection, frame, message.TYPE, deadline, timeout_s)

    def request_soon(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None,
        device_ready: bool = False,
    ) -> Awaitable[Message]:
        """``request``, with the frame posted before this returns where the connection to
        ``peer`` is open: the peer starts on it while the caller computes, before the caller's
        next await. Returns an awaitable of the reply (raising as ``request`` does)."""
        connection = self._outbound.get(peer)
        if connection is None or connection.broken or self._closed:
            # A task of the transport's (close cancels it), whose outcome is read when it ends:
            # a caller may never run the awaitable (a task cancelled before its first step).
            task = asyncio.get_running_loop().create_task(
                self.request(peer, message, timeout_s=timeout_s, device_ready=device_ready))
            self._tasks.add(task)
            task.add_done_callback(self._request_ended)
            return task
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        frame = self._encode_request(message, connection, device_ready, deadline=deadline)
        if frame.frame.buffers:
            wire_trace.record("req.separate_buffers", message.TYPE, len(frame.frame.buffers))
        loop = asyncio.get_running_loop()
        reply = loop.create_future()
        msg_id = frame.msg_id
        connection.pending[msg_id] = reply
        try:
            posted = connection.post_frame(frame.frame, msg_id, False)
            wire_trace.record("req.posted", message.TYPE, msg_id)
        except ConnectionBroken as e:
            connection.pending.pop(msg_id, None)
            self._drop(peer, connection, PeerUnreachable(peer, str(e)))
            _fail(reply, PeerUnreachable(peer, str(e)))
            return reply
        # The request's bookkeeping is set here, not in the awaitable: a caller may never run
        # it (a task cancelled before its first step). The timer ends the wait at the deadline
        # and takes the pending entry away; the frame is kept until UCX sent it.
        timer = loop.call_at(loop.time() + timeout_s, _expire_request, connection, msg_id, reply, deadline)
        if not all(r.completed for r in posted):
            connection.keep_until_sent(posted, frame.frame)
        return self._await_reply(peer, connection, msg_id, reply, timer, message.TYPE, timeout_s, deadline)

    def _request_ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # read here; whoever awaits the task still gets it

    async def _await_reply(self, peer: PeerAddress, connection: _Connection, msg_id: int,
                           reply: asyncio.Future, timer: asyncio.TimerHandle, type_: str,
                           timeout_s: float, deadline: float) -> Message:
        """The reply of a request that ``request_soon`` posted: its frame is kept until sent,
        and a failed send breaks the connection, which fails ``reply``."""
        try:
            return await reply
        except TimeoutError:
            raise RequestTimeout(peer, type_, timeout_s) from None
        finally:
            timer.cancel()
            if connection.pending.get(msg_id) is reply:
                del connection.pending[msg_id]
            connection.release_slots_after(msg_id, deadline)  # where no reply freed them
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed with its connection while this request raised

    def _encode_request(self, message: Message, connection: _Connection,
                        device_ready: bool = False, *, deadline: float) -> _RequestFrame:
        """``deadline``: when the request stops waiting (time.monotonic()); its buffers in
        shared memory are not read from then on."""
        msg_id = next(self._next_msg_id)
        place = connection.place_shared if connection.shared_out is not None and not connection.broken else None
        try:
            frame = codec.encode(
                message, msg_id, inline_limit_bytes=self._config.limits.inline_limit_bytes,
                inline_cuda_limit_bytes=self._config.limits.inline_cuda_limit_bytes,
                max_header_bytes=self._config.limits.max_header_bytes,
                place_shared=place, device_ready=device_ready, shared_until_ns=int(deadline * 1e9),
                place_rows=connection.place_rows if connection.pools_out and not connection.broken else None)
        except BaseException:
            connection.free_new_slots()
            raise
        connection.claim_slots(msg_id)
        wire_trace.record("req.encoded", message.TYPE, msg_id)
        return _RequestFrame(msg_id, frame)

    async def _exchange(self, peer: PeerAddress, connection: _Connection, frame: _RequestFrame, type_: str,
                        deadline: float, timeout_s: float) -> Message:
        """Send ``frame`` and wait for its reply by ``deadline`` (time.monotonic())."""
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None
        posted: list | None = None
        reply = loop.create_future()
        connection.pending[frame.msg_id] = reply
        try:
            posted = connection.post_frame(frame.frame, frame.msg_id, False)
            wire_trace.record("req.posted", type_, frame.msg_id)
            if frame.frame.buffers:
                await connection.wait_sent(posted, deadline)  # a timeout or a cancel: kept below
            # A header alone is not awaited: its reply says it arrived, and a failed send breaks
            # the connection, which fails this reply. ``frame`` and ``posted`` live until then.
            # One timer on the reply rather than asyncio.timeout around the whole request:
            # on a round trip of tens of microseconds the latter's cost shows.
            timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), _expire, reply)
            return await reply
        except TimeoutError:
            raise RequestTimeout(peer, type_, timeout_s) from None
        except ConnectionBroken as e:
            self._drop(peer, connection, PeerUnreachable(peer, str(e)))
            if time.monotonic() >= deadline:
                raise RequestTimeout(peer, type_, timeout_s) from None
            raise PeerUnreachable(peer, str(e)) from None
        finally:
            if timer is not None:
                timer.cancel()
            if posted is not None and not all(r.completed for r in posted):
                connection.keep_until_sent(posted, frame.frame)  # a timeout or a cancel: UCX may still read it
            connection.pending.pop(frame.msg_id, None)
            connection.release_slots_after(frame.msg_id, deadline)  # where no reply freed them
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed with its connection while this request raised

    async def send(
        self, peer: PeerAddress, message: Message, *, timeout_s: float | None = None
    ) -> None:
        timeout_s = self._config.request_timeout_s if timeout_s is None else timeout_s
        msg_id = next(self._next_msg_id)
        frame = codec.encode(message, msg_id, wants_reply=False,
                             inline_limit_bytes=self._config.limits.inline_limit_bytes,
                             inline_cuda_limit_bytes=self._config.limits.inline_cuda_limit_bytes,
                             max_header_bytes=self._config.limits.max_header_bytes)
        deadline = time.monotonic() + timeout_s
        connection: _Connection | None = None
        try:
            connection = await self._connection_by(peer, deadline)
            await connection.send_frame(frame, msg_id, False, deadline)
        except TimeoutError:
            raise RequestTimeout(peer, message.TYPE, timeout_s) from None
        except ConnectionBroken as e:
            self._drop(peer, connection, PeerUnreachable(peer, str(e)))
            if time.monotonic() >= deadline:
                raise RequestTimeout(peer, message.TYPE, timeout_s) from None
            raise PeerUnreachable(peer, str(e)) from None

    async def connect(self, peer: PeerAddress) -> None:
        try:
            await self._connection_by(peer, time.monotonic() + self._config.connect_timeout_s)
        except TimeoutError:
            raise PeerUnreachable(peer, "cannot connect: timed out") from None

    async def close(self) -> None:
        self._closed = True
        # No new inbound connection from here on (one accepted now would be served after the
        # wait below), and no connect attempt left running.
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        attempts = list(self._connecting.values())
        for attempt in attempts:
            attempt.cancel()
        if attempts:
            await asyncio.gather(*attempts, return_exceptions=True)
        for peer, connection in list(self._outbound.items()):
            self._drop(peer, connection, PeerUnreachable(peer, "transport closed"))
        for connection in list(self._inbound):
            connection.abort()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=self._config.frame_timeout_s)
        # The listener's serving loops end once their receives see the aborted endpoints.
        try:
            async with asyncio.timeout(self._config.frame_timeout_s):
                while self._inbound:
                    await asyncio.sleep(0.001)
        except TimeoutError:
            log.warning("%d inbound connections still served after the frame timeout", len(self._inbound))
        if self._shared_region is not None:
            self._shared_region.close()  # peers' mappings of it stay valid

    # --- outbound connections: requests and their replies ---

    async def _connection_for(self, peer: PeerAddress, type_: str, timeout_s: float) -> tuple[_Connection, float]:
        """The connection to ``peer`` and the deadline of a request of ``type_`` that may take
        ``timeout_s`` from now, connecting first where needed; the transport's errors where
        that fails."""
        deadline = time.monotonic() + timeout_s
        try:
            return await self._connection_by(peer, deadline), deadline
        except ConnectionBroken as e:
            raise PeerUnreachable(peer, str(e)) from None
        except TimeoutError:
            raise RequestTimeout(peer, type_, timeout_s) from None

    async def _connection_by(self, peer: PeerAddress, deadline: float) -> _Connection:
        """The connection to ``peer``, made by ``deadline`` (time.monotonic()) if there is none."""
        connection = self._outbound.get(peer)
        if connection is not None and not connection.broken and not self._closed:
            return connection  # the common case: no await, no timer
        async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
            return await self._connection(peer)

    async def _connection(self, peer: PeerAddress) -> _Connection:
        if self._closed:
            raise PeerUnreachable(peer, "transport closed")
        connection = self._outbound.get(peer)
        if connection is not None and not connection.broken:
            return connection
        # Requests that find no connection share one attempt and its outcome, so a burst of
        # requests to a dead peer fails once, not once per request.
        attempt = self._connecting.get(peer)
        if attempt is None:
            attempt = asyncio.ensure_future(self._connect(peer))
            self._connecting[peer] = attempt
            attempt.add_done_callback(lambda done: self._connect_ended(peer, done))
        try:
            return await asyncio.shield(attempt)
        except asyncio.CancelledError:
            # The attempt was cancelled by ``close``, not this caller: say so.
            if attempt.cancelled() and self._closed and not asyncio.current_task().cancelling():
                raise PeerUnreachable(peer, "transport closed") from None
            raise

    def _connect_ended(self, peer: PeerAddress, attempt: asyncio.Future) -> None:
        self._connecting.pop(peer, None)
        if not attempt.cancelled():
            attempt.exception()  # retrieved: every waiter may have timed out before it ended

    async def _connect(self, peer: PeerAddress) -> _Connection:
        if self._progress is None:
            self._progress = _progress_for_loop(self._config.spin_s)
        try:
            async with asyncio.timeout(self._config.connect_timeout_s):
                endpoint = await ucxx.create_endpoint(
                    peer.host, peer.port, connect_timeout=self._config.connect_timeout_s)
        except (UCXError, TimeoutError, OSError, RuntimeError) as e:
            # RuntimeError: ucxx's own exchange of peer information failed (a bad checksum).
            raise PeerUnreachable(peer, f"cannot connect: {e!r}") from None
        if self._closed:  # closed while this connected: nothing may stay open
            endpoint.abort()
            raise PeerUnreachable(peer, "transport closed")
        connection = _Connection(endpoint, str(peer), self._config, self._progress)
        self._outbound[peer] = connection
        self._spawn(self._read_replies(peer, connection))
        region = self._region()
        if region is not None and peer not in self._offer_refused:
            await self._offer_shared_memory(peer, connection, region)
            if connection.broken and peer in self._offer_refused:
                return await self._connect(peer)  # once more, without the offer
        if self._rings_on() and peer not in self._ring_offer_refused and not connection.broken:
            await self._offer_header_ring(peer, connection)
            if connection.broken and peer in self._ring_offer_refused:
                return await self._connect(peer)  # once more, without the offer
        return connection

    def _rings_on(self) -> bool:
        return self._config.header_ring_bytes > 0 and header_ring.supported()

    def _new_ring(self) -> HeaderRing | None:
        """A header ring for one connection's frames from here; None where it cannot be made
        (a full tmpfs): those headers travel over UCX."""
        try:
            return HeaderRing(self._config.shared_memory_dir, self._config.header_ring_bytes)
        except (OSError, ValueError) as e:
            log.warning("no header ring for a local peer (%s): its headers travel over UCX", e)
            return None

    async def _connect_request(self, peer: PeerAddress, connection: _Connection, message: Message) -> Message:
        """A request of a new connection's set-up, within the connect timeout. A peer that
        does not answer fails the connection; its refusals are the caller's."""
        deadline = time.monotonic() + self._config.connect_timeout_s
        try:
            return await self._exchange(peer, connection, self._encode_request(message, connection, deadline=deadline),
                                        message.TYPE, deadline, self._config.connect_timeout_s)
        except RequestTimeout:
            what = f"no answer to the connection's {message.TYPE}"
            self._drop(peer, connection, PeerUnreachable(peer, what))
            raise PeerUnreachable(peer, f"cannot connect: {what}") from None

    async def _offer_header_ring(self, peer: PeerAddress, connection: _Connection) -> None:
        """Offer a ring for this connection's request headers. Where the peer opens it, they
        go through it; where the peer offers one back and it opens here, the replies' headers
        come through that. A refusal (another host) leaves the connection as it is."""
        ring = self._new_ring()
        if ring is None:
            return
        try:
            answer = await self._connect_request(peer, connection, HeaderRingOffer(ring=ring.name, nonce=ring.nonce.hex()))
        except RemoteError as e:
            ring.close()
            log.debug("%s: no header ring: %s", peer, e)
            if e.code == ErrorCode.UNKNOWN_TYPE:
                self._ring_offer_refused.add(peer)  # a peer that predates rings closed the connection
                self._drop(peer, connection, PeerUnreachable(peer, f"the peer refused the offer: {e}"))
            return
        except BaseException:
            ring.close()
            raise
        ring.unlink()  # the peer has opened it: the files' names are of no more use
        if connection.broken:
            ring.close()
            return
        connection.ring_out = ring
        if type(answer) is not HeaderRingAccepted:
            return  # the peer's replies stay on UCX
        try:
            peer_ring = PeerHeaderRing.open(self._config.shared_memory_dir, answer.ring, answer.nonce,
                                            self._config.limits.max_header_bytes)
        except HeaderRingUnavailable as e:
            log.warning("%s: cannot open the peer's header ring (%s): its replies come over UCX", peer, e)
            return
        # Read by the reply loop from its next header on: the answer to HeaderRingOpened comes
        # over UCX and wakes it, and the peer's ring carries only the replies after that one.
        connection.ring_in = peer_ring
        try:
            await self._connect_request(peer, connection, HeaderRingOpened())
        except RemoteError as e:
            log.warning("%s: the peer did not take up its header ring (%s): its replies come over UCX", peer, e)

    def _region(self) -> SharedRegion | None:
        """This transport's shared-memory region, made on first use; None where it is turned
        off or cannot be made (then every buffer travels over UCX)."""
        if (self._shared_region is None and not self._shared_region_failed and not self._closed
                and self._config.shared_memory_bytes > 0):
            try:
                self._shared_region = SharedRegion(self._config.shared_memory_dir,
                                                   self._config.shared_memory_bytes, self._copier())
            except (OSError, ValueError) as e:
                self._shared_region_failed = True
                log.warning("no shared memory for local peers (%s): host buffers travel over UCX", e)
        return self._shared_region

    async def _offer_shared_memory(self, peer: PeerAddress, connection: _Connection,
                                   region: SharedRegion) -> None:
        """Offer the region on a new connection; where the peer maps it, requests' host buffers
        go through it. A refusal (another host) leaves the connection as it is."""
        offer = SharedMemoryOffer(region=region.name, nonce=region.nonce.hex(), clock_ns=time.monotonic_ns())
        deadline = time.monotonic() + self._config.connect_timeout_s
        try:
            await self._exchange(peer, connection, self._encode_request(offer, connection, deadline=deadline),
                                 offer.TYPE, deadline, self._config.connect_timeout_s)
        except RemoteError as e:
            log.debug("%s: no shared memory: %s", peer, e)
            if e.code == ErrorCode.UNKNOWN_TYPE:
                self._offer_refused.add(peer)  # a peer that predates offers closed the connection
                self._drop(peer, connection, PeerUnreachable(peer, f"the peer refused the offer: {e}"))
            return
        except RequestTimeout:
            self._drop(peer, connection, PeerUnreachable(peer, "no answer to the connection's first request"))
            raise PeerUnreachable(peer, "cannot connect: no answer to the connection's first request") from None
        connection.shared_out = region

    async def _read_replies(self, peer: PeerAddress, connection: _Connection) -> None:
        try:
            while True:
                # An outbound connection idles only while nothing is pending (``busy``).
                header = await connection.recv_header(self._config.idle_timeout_s)
                wire_trace.record("reply.header", header.message.TYPE, -1 if header.reply_to is None else header.reply_to)
                if header.reply_to is not None and connection.shared_slots:
                    connection.free_slots(header.reply_to)  # the peer copied them out first
                if header.reply_to is None:
                    if isinstance(header.message, ErrorReply):  # the peer refused a frame
                        raise RemoteError(peer, header.message.code, header.message.detail)
                    raise ProtocolError(ErrorCode.INVALID_FIELDS, "a request on a reply path")
                if self._lands_whole_on_host(header):
                    destinations = codec.host_tensors_of_inline(header)
                else:
                    destinations = self._fresh_destinations(header)
                    requests = connection.post_buffer_recvs(header, destinations)
                    if connection.lands_in_background(requests, header):
                        self._spawn(self._land_reply(peer, connection, header, destinations, requests))
                        continue
                    await connection.land_buffers(header, destinations, requests)
                delivered = _deliver_reply(peer, connection, header, destinations)
                if type(header.message) is ErrorReply and header.message.code in codec.REFUSAL_CODES:
                    # The peer refused that request's frame and closes the connection: the
                    # request has its RemoteError; the others there fail as on any close.
                    raise ConnectionBroken(f"the peer refused a frame ({header.message.code.value}: "
                                           f"{header.message.detail}) and closes the connection")
                if delivered:
                    # The requester runs before this loop posts its next receive and spins: it
                    # is what waits on this reply (4-7% of a 1 KiB round trip on the CPU), and
                    # a reply that comes meanwhile waits in UCX, which takes it when the
                    # receive is posted.
                    await asyncio.sleep(0)
        except Exception as e:  # noqa: BLE001
            self._reading_failed(peer, connection, e)

    async def _land_reply(self, peer: PeerAddress, connection: _Connection, header: codec.FrameHeader,
                          destinations: list, requests: list) -> None:
        try:
            await connection.land_buffers(header, destinations, requests)
            _deliver_reply(peer, connection, header, destinations)
        except Exception as e:  # noqa: BLE001
            self._reading_failed(peer, connection, e)
        finally:
            connection.landed_in_background()

    def _reading_failed(self, peer: PeerAddress, connection: _Connection, error: Exception) -> None:
        """A reply could not be read: the connection is of no more use. The requests waiting
        on it fail with PeerUnreachable; with RemoteError where the peer refused a frame it
        could not tell (an ErrorReply answering no request: every request there may be it)."""
        if isinstance(error, RemoteError):
            self._drop(peer, connection, error)
        elif isinstance(error, ProtocolError):  # a reply refused here (oversized, its buffers never came)
            log.warning("refused a reply from %s: %s", peer, error)
            self._drop(peer, connection, PeerUnreachable(peer, f"a reply could not be read: {error}"))
        elif isinstance(error, ConnectionBroken):
            self._drop(peer, connection, PeerUnreachable(peer, str(error)))
        else:  # a bug, or no memory for a reply
            log.error("reading replies from %s failed", peer, exc_info=error)
            self._drop(peer, connection, PeerUnreachable(peer, f"reading replies failed: {error!r}"))

    def _drop(self, peer: PeerAddress, connection: _Connection | None, error: Exception) -> None:
        if connection is None:
            return
        connection.abort()
        connection.fail_pending(error)
        if self._outbound.get(peer) is connection:
            del self._outbound[peer]

    # --- inbound connections: serving requests ---

    async def _serve_connection(self, endpoint: ucxx._lib_async.Endpoint) -> None:
        if self._closed:  # accepted while closing
            endpoint.abort()
            return
        connection = _Connection(endpoint, f"inbound {endpoint.uid:#x}", self._config,
                                 self._progress)
        self._inbound.add(connection)
        try:
            while True:
                header = None
                try:
                    header = await connection.recv_header(self._config.idle_timeout_s)
                    wire_trace.record("in.header", header.message.TYPE, header.msg_id)
                    if header.reply_to is not None:
                        raise ProtocolError(ErrorCode.INVALID_FIELDS, "a reply on a request path")
                    await self._receive_request(connection, header)
                except ProtocolError as e:
                    # The refusal answers the frame where its id is known: decoded, or read
                    # from a header that did not decode (``recv_header``).
                    await self._refuse(connection, e, getattr(e, "msg_id", None) if header is None else header.msg_id)
                    return
        except ConnectionBroken:
            return
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not take the listener down
            log.exception("serving %s failed", connection.label)
        finally:
            connection.abort()
            self._inbound.discard(connection)

    async def _receive_request(self, connection: _Connection, header: codec.FrameHeader) -> None:
        refusal: ErrorReply | None = None
        destinations = None
        if self._placer is not None:
            try:
                destinations = self._placer(header.message)
                if destinations is not None:
                    destinations = list(destinations)
                    codec.check_destinations(header, destinations)
            except (PlacementRefused, ValueError) as e:
                refusal = ErrorReply(ErrorCode.PLACEMENT_REFUSED, str(e))
                destinations = None
        if header.shared_offsets and time.monotonic_ns() >= header.shared_until_ns:
            # Its sender has stopped waiting and may be using those slots again: answered, and
            # the connection serves on.
            refusal = ErrorReply(ErrorCode.EXPIRED, "the request's buffers in shared memory were past their "
                                 "time when it was read")
            destinations = None
        if refusal is not None:  # its buffers drained into host scratch, its reply the refusal
            destinations, requests = connection.post_scratch_recvs(header)
        elif destinations is None and self._lands_whole_on_host(header):
            destinations = codec.host_tensors_of_inline(header)
            requests = None
        else:
            if destinations is None:
                destinations = self._fresh_destinations(header, connection)
            requests = connection.post_buffer_recvs(header, destinations)
        if requests is not None:
            if connection.lands_in_background(requests, header):  # e.g. a move's KV blocks, ahead of attend requests
                self._spawn(self._land_and_dispatch(connection, header, destinations, requests, refusal))
                return
            await connection.land_buffers(header, destinations, requests, land_shared=refusal is None)
        await self._deliver(connection, header, destinations, refusal)

    async def _land_and_dispatch(self, connection: _Connection, header: codec.FrameHeader, destinations: list,
                                 requests: list, refusal: ErrorReply | None) -> None:
        try:
            await connection.land_buffers(header, destinations, requests, land_shared=refusal is None)
            await self._deliver(connection, header, destinations, refusal)
        except ProtocolError as e:
            await self._refuse(connection, e, header.msg_id)
        except ConnectionBroken:
            pass  # the connection's loop ends with it
        except Exception:  # as in the connection's loop: the requester hears at once, not at its timeout
            log.exception("serving %s failed", connection.label)
            connection.abort()
        finally:
            connection.landed_in_background()

    async def _deliver(self, connection: _Connection, header: codec.FrameHeader, destinations: list,
                       refusal: ErrorReply | None) -> None:
        """A landed frame: its refusal answered, or its message handed to the handler."""
        wire_trace.record("in.landed", header.message.TYPE, header.msg_id)
        if refusal is not None:
            if header.wants_reply:
                await self._reply(connection, header.msg_id, refusal)
            return
        message = codec.assemble(header, destinations)
        wire_trace.record("in.assembled", header.message.TYPE, header.msg_id)
        self._dispatch(connection, header, message)

    def _dispatch(self, connection: _Connection, header: codec.FrameHeader, message: Message) -> None:
        """Run the handler. One that answers at once (a plain function) is answered here, with
        no task; one that returns an awaitable runs as a task of its own, so that a slow
        handler never holds up the connection's next frame."""
        if type(message) is SharedMemoryOffer:
            outcome: object = self._accept_shared_memory(connection, message)
        elif type(message) is HeaderRingOffer:
            outcome = self._accept_header_ring(connection, message)
        elif type(message) is HeaderRingOpened:
            self._open_reply_ring(connection, header)
            return
        elif type(message) is DevicePoolOffer:
            outcome = self._accept_device_pool(connection, message)
        elif self._handler is None:
            outcome = ErrorReply(ErrorCode.NO_HANDLER, "transport not started")
        else:
            try:
                outcome = self._handler(message)
            except Exception as e:  # the handler's failure is the requester's to see
                outcome = _handler_failed(message, e)
        wire_trace.record("in.handled", message.TYPE, header.msg_id)
        if inspect.isawaitable(outcome):
            connection.handling += 1
            self._spawn(self._finish(connection, header, message, outcome))
        elif header.wants_reply:
            self._post_reply(connection, header.msg_id, _as_reply(message, outcome))

    async def _finish(self, connection: _Connection, header: codec.FrameHeader, message: Message,
                      pending: Awaitable[Message | None]) -> None:
        try:
            try:
                reply = _as_reply(message, await pending)
            except Exception as e:
                reply = _handler_failed(message, e)
            if header.wants_reply:
                await self._reply(connection, header.msg_id, reply)
        finally:
            connection.handling -= 1

    def _accept_shared_memory(self, connection: _Connection, offer: SharedMemoryOffer) -> Message:
        """Map the region a new connection's peer offers, if it is on this host's shared memory."""
        if self._config.shared_memory_bytes <= 0:
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE, "turned off here")
        lag_ns = time.monotonic_ns() - offer.clock_ns
        if not 0 <= lag_ns <= MAX_OFFER_CLOCK_LAG_NS:
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE,
                              f"this process's CLOCK_MONOTONIC is {lag_ns / 1e9:.3f} s past the offer's: not the same clock")
        try:
            region = PeerRegion.open(self._config.shared_memory_dir, offer.region, offer.nonce, self._copier())
        except SharedMemoryUnavailable as e:
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE, str(e))
        if connection.shared_in is not None:
            connection.shared_in.close()
        connection.shared_in = region
        return Ack()

    def _accept_device_pool(self, connection: _Connection, offer: DevicePoolOffer) -> Message:
        """Map the device pool a peer offers, if this process receives on a GPU that can read it
        (the same one, or one of the same host with peer access)."""
        if not self._config.device_pools:
            return ErrorReply(ErrorCode.DEVICE_POOL_UNAVAILABLE, "device pools are turned off here")
        if offer.pool_id in connection.pools_in:
            # The same offer again (the first one's answer came after its requester gave up):
            # mapped already. Another pool under a taken id is refused.
            if connection.pool_handles_in.get(offer.pool_id) == offer.handle:
                return Ack()
            return ErrorReply(ErrorCode.DEVICE_POOL_UNAVAILABLE, f"pool {offer.pool_id} is mapped already")
        device = torch.device(self._config.receive_device)
        try:
            pool = open_pool(offer, device)
            rows = row_words(pool)
        except DevicePoolUnavailable as e:
            return ErrorReply(ErrorCode.DEVICE_POOL_UNAVAILABLE, str(e))
        except (RuntimeError, ValueError) as e:  # a layout that makes no rows (a dimension of 0)
            return ErrorReply(ErrorCode.DEVICE_POOL_UNAVAILABLE, f"the pool's layout makes no rows: {e}")
        connection.pull_stream, connection.pull_slots = self._pull_streams_on(device)
        if connection.pull_graphs is None and self._config.pull_graphs:
            connection.pull_graphs = PullGraphs()
        connection.pools_in[offer.pool_id] = rows
        connection.pool_handles_in[offer.pool_id] = offer.handle
        return Ack()

    def _pull_streams_on(self, device: torch.device) -> tuple[object, PullSlots]:
        """The stream that rows pulled out of mapped pools are copied on, on ``device``, and its
        slots; made once, with one slot."""
        if device not in self._pull_streams:
            stream, slots = torch.cuda.Stream(device), PullSlots(device)
            with torch.cuda.stream(stream):
                slots.give_back(slots.take(1))
            self._pull_streams[device] = stream, slots
        return self._pull_streams[device]

    def _accept_header_ring(self, connection: _Connection, offer: HeaderRingOffer) -> Message:
        """Read the headers of a connection's requests from the ring its peer offers, if it is
        in this host's shared memory, and offer one back for the replies."""
        if not self._rings_on():
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE, "header rings are turned off here")
        if connection.ring_in is not None or connection.ring_offered is not None or connection.ring_out is not None:
            # The requester writes on into the ring it offered first: that one is read on.
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE, "this connection has its header rings already")
        try:
            ring_in = PeerHeaderRing.open(self._config.shared_memory_dir, offer.ring, offer.nonce,
                                          self._config.limits.max_header_bytes)
        except HeaderRingUnavailable as e:
            return ErrorReply(ErrorCode.SHARED_MEMORY_UNAVAILABLE, str(e))
        connection.ring_in = ring_in  # this connection's loop reads it from its next header on
        ring = connection.ring_offered = self._new_ring()
        if ring is None:
            return Ack()
        # Its names go once the requester says it opened it, or after a while if it never does
        # (it could not open it: its replies then stay on UCX).
        asyncio.get_running_loop().call_later(OFFERED_RING_NAMES_S, ring.unlink)
        return HeaderRingAccepted(ring=ring.name, nonce=ring.nonce.hex())

    def _open_reply_ring(self, connection: _Connection, header: codec.FrameHeader) -> None:
        """The requester opened the ring offered for the replies: answer over UCX, then send
        the headers of the replies after that answer through the ring."""
        ring = connection.ring_offered
        if header.wants_reply:
            self._post_reply(connection, header.msg_id, Ack() if ring is not None else ErrorReply(
                ErrorCode.SHARED_MEMORY_UNAVAILABLE, "no header ring is offered on this connection"))
        if ring is None:
            return
        ring.unlink()
        connection.ring_offered = None
        if connection.ring_out is not None:
            connection.ring_out.close()
        connection.ring_out = ring

    def _copier(self) -> ParallelCopy:
        if self._shared_copy is None:
            self._shared_copy = ParallelCopy(self._config.shared_memory_copy_threads or default_copy_threads())
        return self._shared_copy

    def _lands_whole_on_host(self, header: codec.FrameHeader) -> bool:
        """Every buffer of the frame came inline and lands in host memory: its tensors are made
        from the header's bytes (``codec.host_tensors_of_inline``), with nothing to receive."""
        return self._inline_lands_on_host and all(header.inline)

    def _fresh_destinations(self, header: codec.FrameHeader, connection: _Connection | None = None) -> list[object]:
        device = self._config.landing_device(all(header.inline))
        # Rows pulled into them: allocated on the stream that writes them, as memory from another
        # stream's pool could still be read there by kernels queued before.
        pulled = header.pool_rows and connection is not None and connection.pull_stream is not None
        with torch.cuda.stream(connection.pull_stream) if pulled else contextlib.nullcontext():
            return [allocate(s, device) for s in header.specs]

    def _encode_reply(self, msg_id: int, reply: Message) -> tuple[int, codec.EncodedFrame]:
        """The reply's id and frame; one that cannot be encoded (a handler's bad tensor) becomes
        an ErrorReply, so that the requester hears why and the connection serves on."""
        reply_id = next(self._next_msg_id)
        try:
            return reply_id, self._encode(reply, reply_id, msg_id)
        except Exception as e:  # noqa: BLE001
            log.error("a %s reply could not be encoded", codec.type_name(reply), exc_info=e)
            return reply_id, self._encode(codec.unencodable_reply(reply, e), reply_id, msg_id)

    def _encode(self, reply: Message, reply_id: int, msg_id: int) -> codec.EncodedFrame:
        return codec.encode(reply, reply_id, reply_to=msg_id, wants_reply=False,
                            inline_limit_bytes=self._config.limits.inline_limit_bytes,
                            inline_cuda_limit_bytes=self._config.limits.inline_cuda_limit_bytes,
                            max_header_bytes=self._config.limits.max_header_bytes)

    def _post_reply(self, connection: _Connection, msg_id: int, reply: Message) -> None:
        """Post a reply; a task waits for its sending only where UCX has not sent it yet."""
        # The frame owns the reply's buffers (e.g. an attend result's out and lse): it must live
        # until UCX has sent them, or a rendezvous send reads freed memory.
        reply_id, frame = self._encode_reply(msg_id, reply)
        wire_trace.record("reply.encoded", reply.TYPE, msg_id)
        if frame.buffers:
            wire_trace.record("reply.separate_buffers", reply.TYPE, len(frame.buffers))
        try:
            requests = connection.post_frame(frame, reply_id, True)
        except ConnectionBroken:
            return  # the requester is gone; its side reports that
        wire_trace.record("reply.posted", reply.TYPE, msg_id)
        if not all(r.completed for r in requests):
            connection.keep_until_sent(requests, frame)

    async def _reply(self, connection: _Connection, msg_id: int, reply: Message) -> None:
        reply_id, frame = self._encode_reply(msg_id, reply)
        try:
            await connection.send_frame(frame, reply_id, True)
        except ConnectionBroken:
            pass  # the requester is gone; its side reports that

    async def _refuse(self, connection: _Connection, error: ProtocolError, msg_id: int | None) -> None:
        """Tell the peer why, then close: after a bad frame the stream cannot be trusted. The
        ErrorReply answers the refused frame where its id could be read (``msg_id``), so that
        its request fails with RemoteError and the requester's others with PeerUnreachable."""
        log.warning("refused a frame from %s: %s", connection.label, error)
        reply_id = next(self._next_msg_id)
        frame = codec.encode(ErrorReply(error.code, error.detail), reply_id, reply_to=msg_id,
                             wants_reply=False, max_header_bytes=self._config.limits.max_header_bytes)
        try:
            await connection.send_frame(frame, reply_id, True)
        except ConnectionBroken:
            pass
        connection.abort()

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass(frozen=True)
class _RequestFrame:
    msg_id: int
    frame: codec.EncodedFrame


def _offer_done(offers: dict, key: tuple, offer: asyncio.Task) -> None:
    """A device pool's offer ended: it leaves the connection's offers, and its failure is
    taken here, for where every caller gave up waiting before it came."""
    if offers.get(key) is offer:
        del offers[key]
    if not offer.cancelled():
        offer.exception()


def _as_reply(request: Message, outcome: object) -> Message:
    """What a handler's return value answers: Ack for None; an ErrorReply saying so for
    something that is no message of the wire."""
    if outcome is None:
        return Ack()
    if type(outcome) in codec.MESSAGE_CLASSES:
        return outcome
    return _handler_failed(request, TypeError(f"the handler returned a {type(outcome).__name__}, not a message"))


def _handler_failed(message: Message, error: Exception) -> ErrorReply:
    if isinstance(error, ValueError):  # a handler's refusal of what it was asked: the sender hears why
        log.warning("refused %s: %s", message.TYPE, error)
    else:
        log.error("handler failed on %s", message.TYPE, exc_info=error)
    return ErrorReply(ErrorCode.HANDLER_FAILED, f"{type(error).__name__}: {error}")


# A reader that takes this many headers in a row from a ring progresses UCX once.
RING_HEADERS_PER_PROGRESS = 8
# A ring offered for a connection's replies keeps its files' names this long at most when the
# requester never says it opened it, s (the names go at once when it does).
OFFERED_RING_NAMES_S = 10.0


def _succeeded(request) -> bool:
    """Whether a completed UCX request ended without an error."""
    try:
        request.check_error()
    except UCXError:
        return False
    return True


# A buffer at least this large is copied out of a peer's region on a thread, bytes.
_SHARED_COPY_ON_THREAD_BYTES = 16 << 20
# A request's slots in shared memory are used again this long after its time (``su``) where no
# reply freed them: past its time the peer copies nothing out of them, on the same clock.
SHARED_SLOTS_GRACE_S = 0.5
# A peer whose shared memory is mapped must read CLOCK_MONOTONIC as this process does (times in
# frames say when their slots stop being read): its offer's clock may lag this one's by as much
# as the offer took to come and be handled, never lead it.
MAX_OFFER_CLOCK_LAG_NS = 5_000_000_000
# Frames of one inbound connection whose buffers land in the background at once; the next waits
# in the connection's loop (and so do the frames behind it).
MAX_FRAMES_RECEIVING = 8


def _deliver_reply(peer: PeerAddress, connection: _Connection, header: codec.FrameHeader, destinations: list) -> bool:
    """A landed reply to the request that waits for it; False where none waits (that request
    timed out)."""
    wire_trace.record("reply.landed", header.message.TYPE, header.reply_to)
    reply = codec.assemble(header, destinations)
    future = connection.pending.pop(header.reply_to, None)
    if future is None or future.done():
        return False
    if isinstance(reply, ErrorReply):
        _fail(future, RemoteError(peer, reply.code, reply.detail))
    else:
        future.set_result(reply)
    wire_trace.record("reply.set", reply.TYPE, header.reply_to)
    return True


def _ensure_in_time(until_ns: int) -> None:
    if time.monotonic_ns() >= until_ns:
        raise ProtocolError(ErrorCode.EXPIRED, "the request's buffers in shared memory were past their time")


def _free_slots(region: SharedRegion, slots) -> None:
    """Free the slots copied into (offsets); the buffers lent as they lay (arrays) are let go."""
    for slot in slots:
        if type(slot) is int:
            region.free(slot)


def _expire(future: asyncio.Future) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def _expire_request(connection: _Connection, msg_id: int, future: asyncio.Future, deadline: float) -> None:
    """A ``request_soon``'s deadline: its wait ends, its pending entry goes and its slots in
    shared memory are freed soon, whether or not its awaitable ever ran."""
    _fail(future, TimeoutError())
    if connection.pending.get(msg_id) is future:
        del connection.pending[msg_id]
    connection.release_slots_after(msg_id, deadline)


def _fail(future: asyncio.Future, error: Exception) -> None:
    """Fail ``future`` if it still waits; marked retrieved (whoever awaits it still gets the
    error): the awaitable of a ``request_soon`` may never run."""
    if not future.done():
        future.set_exception(error)
        future.exception()


# The options of this process's UCX context (the benchmark's bare ucxx anchor starts its own
# with the same, so that both use the same paths):
# - CM_REUSEADDR: a restarted daemon listens on its port again at once; the killed listener's
#   connections hold the port in TIME_WAIT for a minute otherwise.
# Not MM_ERROR_HANDLING. It lets shared memory carry endpoints with peer error handling (every
# ucxx endpoint has it; without it, processes of one host talk over TCP loopback), but a peer
# killed while sending can wedge the receiver. Rounds of: a fresh listener, a process flooding
# it with 16 MiB requests killed with SIGKILL, a new connection to the listener. With the
# option, that connection timed out in 5 of 8 and 11 of 12 rounds, and in one of three runs of
# tests/transport's client-killed case after the daemon tests; without it, in 0 of 8.
# docs/transport.md has the figures it would give.
UCX_CONTEXT_OPTIONS = {"CM_REUSEADDR": "y"}

_progress_by_loop: dict[asyncio.AbstractEventLoop, UcxProgress] = {}


def _progress_for_loop(spin_s: float) -> UcxProgress:
    """The running loop's UcxProgress, starting UCX on first use.

    UCX has one context per process, bound to the event loop that started it. It runs in
    ``blocking`` progress mode: no progress thread, no polling task; UcxProgress progresses
    the worker on this loop. The first transport's ``spin_s`` holds for the loop.

    The context takes ``UCX_CONTEXT_OPTIONS``.
    """
    loop = asyncio.get_running_loop()
    progress = _progress_by_loop.get(loop)
    if progress is not None:
        return progress
    try:
        ucxx.init(options=UCX_CONTEXT_OPTIONS, progress_mode="blocking")
    except RuntimeError:
        pass  # already initiated
    context = ucxx.core._get_ctx()
    if context.progress_mode != "blocking":
        raise RuntimeError(f"ucxx was initialised in {context.progress_mode!r} progress mode; "
                           "this transport needs 'blocking' (it progresses UCX itself)")
    context.continuous_ucx_progress(loop)  # ucxx's reader on the worker's fd, replaced next
    progress = UcxProgress(context.worker, loop, spin_s)
    _progress_by_loop[loop] = progress
    return progress
