"""The buffers of a KV move: one per destination run, gathered from the source pool.

A run whose source blocks are consecutive is a view of the pool (no copy); one whose sources
are scattered is gathered with one ``index_select`` on the pool's device, queued on the
current stream: the codec waits for it before UCX reads the buffer on its own streams.

``KVPacker`` sends a move as a daemon's mover does. To a peer that mapped the pool (a local
peer, ``device_pools``) a move's buffers are its source rows, named by id: the peer copies
them out of the pool itself, and nothing is gathered here. To any other peer, a device
pool's gathers come with an event recorded after them, which the caller polls from its event loop (``wait_for_event``) instead
of the codec blocking the loop on a stream wait. Its gathers of a few blocks replay CUDA graphs
captured at ``prepare`` (``GatherGraph``): the host's work of a gather, on the thread that also
drives UCX, is what kept a batch of small blocks well below a contiguous send.

A gather from a host pool goes into a ``HostStaging`` buffer where the caller keeps one. A
fresh host buffer of a few MiB is fresh pages, and the gather faults every one of them in:
on the development CPU, 64 blocks of 64 KiB took 0.3-0.9 ms to gather into fresh memory
against 0.1 ms into memory gathered into before. (Device pools need none: the caching
allocator hands the same memory out again.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from infinite_llm.transport.block_runs import PackedRun, destination_runs
from infinite_llm.transport.codec import REFUSAL_CODES
from infinite_llm.transport.device_pools import PoolRows, row_index
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.graph_capture import capture
from infinite_llm.transport.interface import PeerAddress, Transport
from infinite_llm.transport.messages import BlockRun, Message

log = logging.getLogger(__name__)


class HostStaging:
    """Host buffers that gathered runs are packed into, used again once their move is done.

    A buffer is taken back (``give_back``) only after the request that carried it completed:
    its reply means the peer holds the data, so UCX reads the buffer no more. A buffer whose
    move failed is never given back (UCX may still read it) and is freed with its last view.
    """

    def __init__(self, max_free: int = 4,
                 allocate: Callable[[int], torch.Tensor | None] | None = None) -> None:
        self.max_free = max_free  # buffers kept for use again, the largest
        self._free: list[torch.Tensor] = []  # flat uint8 host tensors
        # Where new buffers come from (a flat uint8 host tensor of n bytes, or None): the
        # transport's shared memory, whose buffers go to a local peer with no copy.
        self._allocate = allocate

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of ``shape`` and ``dtype``, on memory used before where a
        free buffer is large enough (the smallest such), else fresh."""
        nbytes = math.prod(shape) * dtype.itemsize
        fits = [b for b in self._free if b.numel() >= nbytes]
        if fits:
            buffer = min(fits, key=torch.Tensor.numel)
            self._free.remove(buffer)
        else:
            buffer = self._allocate(max(nbytes, 1)) if self._allocate is not None else None
            if buffer is None:
                buffer = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        tensor = buffer[:nbytes].view(dtype).view(shape)
        # The tensor names its buffer and where it came from, for give_back. Nothing here
        # refers to a lent buffer: one never given back is freed with the tensor.
        tensor._staging_buffer = (self, buffer)
        return tensor

    def give_back(self, tensors: Iterable[torch.Tensor]) -> None:
        """The buffers among ``tensors`` that came from ``take`` may be taken again (others,
        e.g. views of the pool, are passed over)."""
        for tensor in tensors:
            owner, buffer = getattr(tensor, "_staging_buffer", (None, None))
            if owner is self:
                del tensor._staging_buffer  # given back once
                self._free.append(buffer)
        if len(self._free) > self.max_free:
            self._free.sort(key=torch.Tensor.numel, reverse=True)
            del self._free[self.max_free:]

    @property
    def num_free(self) -> int:
        return len(self._free)


def pack_kv_runs(pool: torch.Tensor, src_block_ids: list[int] | tuple[int, ...],
                 dst_block_ids: list[int] | tuple[int, ...],
                 staging: HostStaging | None = None,
                 graphs: GatherGraphs | None = None) -> tuple[tuple[BlockRun, ...], tuple[torch.Tensor, ...]]:
    """``(runs, buffers)`` for a ``KVBlocks`` message moving ``src_block_ids`` of ``pool``
    (``[num_blocks, ...]``, one block per leading index) into ``dst_block_ids``.

    ``buffers[i]``: ``[runs[i].num_blocks, *pool.shape[1:]]``, the pool's dtype and device.
    ``staging``: where gathers from a host pool go (give them back after the move).
    ``graphs``: captured gathers of this (device) pool, used where one is free and large enough.
    """
    packed: list[PackedRun] = destination_runs(src_block_ids, dst_block_ids)
    buffers = []
    for run in packed:
        if run.src_consecutive:
            first = run.src_block_ids[0]
            buffers.append(pool[first:first + run.num_blocks])
            continue
        gathered = graphs.gather(run.src_block_ids) if graphs is not None else None
        if gathered is not None:
            buffers.append(gathered)
            continue
        index = row_index(run.src_block_ids, pool.device)
        if staging is not None and pool.device.type == "cpu":
            out = staging.take((run.num_blocks, *pool.shape[1:]), pool.dtype)
            buffers.append(torch.index_select(pool, 0, index, out=out))
        else:
            buffers.append(pool.index_select(0, index))
    return tuple(BlockRun(r.dst_block_id, r.num_blocks) for r in packed), tuple(buffers)


# Captured gathers write into buffers of their own, kept for the daemon's life: at most this
# many bytes each, and this many of each size (the moves a mover and a creditor's forwards have
# in flight at once, beyond which a gather is an index_select as before).
GATHER_GRAPH_MAX_BYTES = 8 << 20
GATHER_GRAPHS_PER_SIZE = 4


def gather_graph_sizes(num_pool_blocks: int, block_nbytes: int,
                       max_bytes: int = GATHER_GRAPH_MAX_BYTES) -> tuple[int, ...]:
    """The block counts gathers are captured for: powers of two from 2 (a run of one block is
    a view), as long as that many blocks fit ``max_bytes`` and the pool."""
    sizes = []
    size = 2
    while size <= num_pool_blocks and size * block_nbytes <= max_bytes:
        sizes.append(size)
        size *= 2
    return tuple(sizes)


class GatherGraph:
    """One captured gather of ``capacity`` blocks of a device pool into a buffer of its own.

    A gather of n <= capacity blocks writes their ids into a pinned host buffer and replays the
    graph (the ids copied up, then one ``index_select``) on the current stream: one launch, in
    16-19 us of host time on the H200's host against 40-47 us for the ids copied up from pageable
    memory and an ``index_select`` launched eagerly. The ids past n are those of earlier gathers
    (valid blocks of the pool): their rows are gathered too, beyond the n rows handed out.
    ``out``: ``[capacity, *pool.shape[1:]]``, the pool's dtype and device.

    It may be used again only once the device has passed its replay (the pinned ids are read by
    the replay's copy) and no one reads the buffer any more: ``KVPacker`` takes it back when
    the move's peer has answered.
    """

    def __init__(self, pool: torch.Tensor, capacity: int, stream: torch.cuda.Stream,
                 memory_pool: tuple[int, int]) -> None:
        self.capacity = capacity
        # The graph reads and writes these by address: kept as long as it is.
        ids_host = torch.zeros(capacity, dtype=torch.int64, pin_memory=True)
        self._ids_host = ids_host
        self._ids = ids_host.numpy()  # written from the host before each replay
        ids_device = torch.zeros(capacity, dtype=torch.int64, device=pool.device)
        self._ids_device = ids_device
        self.out = torch.empty((capacity, *pool.shape[1:]), dtype=pool.dtype, device=pool.device)
        self.graph = torch.cuda.CUDAGraph()
        out = self.out

        def body() -> None:
            ids_device.copy_(ids_host, non_blocking=True)
            torch.index_select(pool, 0, ids_device, out=out)
        with torch.cuda.stream(stream):
            capture(self.graph, memory_pool, body)

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """``[len(block_ids), *pool.shape[1:]]``: the blocks, gathered on the current stream."""
        n = len(block_ids)
        self._ids[:n] = block_ids
        self.graph.replay()
        return self.out[:n]


class GatherGraphs:
    """A device pool's captured gathers, by size, free or lent to a move's buffer."""

    def __init__(self, pool: torch.Tensor, stream: torch.cuda.Stream, per_size: int = GATHER_GRAPHS_PER_SIZE,
                 max_bytes: int = GATHER_GRAPH_MAX_BYTES) -> None:
        self._free: dict[int, list[GatherGraph]] = {}
        self.num_retired = 0  # graphs of failed moves, never lent again
        sizes = gather_graph_sizes(len(pool), pool[0].nbytes, max_bytes)
        if not sizes or per_size <= 0:
            return
        # Each captured operation runs once first, as torch asks (lazy initialisation, kernels
        # loaded) on the stream the captures use, which waits for the pool's writers.
        stream.wait_stream(torch.cuda.current_stream(pool.device))
        with torch.cuda.stream(stream):
            for size in sizes:
                ids = torch.zeros(size, dtype=torch.int64, pin_memory=True)
                torch.index_select(pool, 0, ids.to(pool.device, non_blocking=True))
        stream.synchronize()
        memory_pool = torch.cuda.graph_pool_handle()
        for size in sizes:
            self._free[size] = [GatherGraph(pool, size, stream, memory_pool) for _ in range(per_size)]
        stream.synchronize()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(self._free)

    @property
    def num_free(self) -> int:
        return sum(len(graphs) for graphs in self._free.values())

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor | None:
        """The blocks gathered by the smallest free graph that holds them (see
        ``GatherGraph.gather``), the buffer tagged for ``give_back``; None where no graph is
        large enough or free."""
        n = len(block_ids)
        for size, graphs in self._free.items():  # ascending
            if size >= n and graphs:
                graph = graphs.pop()
                buffer = graph.gather(block_ids)
                buffer._gather_graph = (self, graph)
                return buffer
        return None

    def give_back(self, buffer: torch.Tensor) -> None:
        owner, graph = getattr(buffer, "_gather_graph", (None, None))
        if owner is self:
            del buffer._gather_graph  # given back once
            self._free[graph.capacity].append(graph)

    def retire(self, buffer: torch.Tensor) -> GatherGraph | None:
        """The graph that gathered ``buffer``, never to be lent again (UCX may still read the
        buffer of a failed send); None for a buffer it did not lend."""
        owner, graph = getattr(buffer, "_gather_graph", (None, None))
        if owner is not self:
            return None
        del buffer._gather_graph
        self.num_retired += 1
        return graph


class KVPacker:
    """Packs moves' buffers (``pack_kv_runs``) for a sender that keeps its event loop turning.

    A host pool's gathers go into ``staging`` (give them back once the move is answered). A
    device pool's are queued on the pool's current stream, behind the kernels that wrote the
    blocks, and come with the event recorded after them: the caller awaits ``wait_for_event``
    and then encodes the message with ``device_ready`` (the codec would otherwise wait for the
    whole stream with the event loop blocked, a step's kernels queued after the gather too).
    The gathers are not put on a stream of their own: that stream would wait for the current
    one all the same, and on the H200 switching to it cost the gather more host time than the
    batch could spare (``docs/performance.md``).
    """

    def __init__(self, staging: HostStaging | None = None, graphs_per_size: int = GATHER_GRAPHS_PER_SIZE,
                 graph_max_bytes: int = GATHER_GRAPH_MAX_BYTES, map_pools: bool = True) -> None:
        self.staging = staging if staging is not None else HostStaging()
        # Whether moves to a peer that can map the pool go as row ids (``send``).
        self.map_pools = map_pools
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        # Captured gathers per device pool (by its storage), made at ``prepare``.
        self._graphs: dict[tuple, GatherGraphs | None] = {}
        self.graphs_per_size = graphs_per_size  # 0: none captured
        self.graph_max_bytes = graph_max_bytes
        # Graphs of failed moves, each kept (its pinned ids with it) until the device has passed
        # the event after its replay: freed earlier, the pinned memory could be handed to other
        # code and its ids overwritten before a replay still queued has read them.
        self._retired: list[tuple[torch.cuda.Event | None, GatherGraph]] = []

    def prepare(self, pool: torch.Tensor) -> None:
        """Make the encoding stream for a device pool (``on_stream``) and gather some of its
        blocks once, now, while nothing is queued: making a CUDA stream, a kernel's first launch
        (CUDA loads modules lazily) and a process's first copy up from pageable memory each wait
        for the device's queued work (162 ms behind a step's kernels on the H200, for the
        stream), which the first move would otherwise do with the event loop blocked."""
        if not pool.is_cuda or self._graphs_key(pool) in self._graphs:
            return
        if pool.device not in self._streams:
            self._streams[pool.device] = torch.cuda.Stream(pool.device)
            # Torch gathers up to 16 indices with one kernel and more with another: both, once
            # (the gathers that no captured graph takes).
            for num_blocks in (2, 17):
                if len(pool) >= num_blocks:
                    pack_kv_runs(pool, list(reversed(range(num_blocks))), list(range(num_blocks)))
        try:  # captured on the packer's stream: idle, and making another waits for the device
            graphs = GatherGraphs(pool, self._streams[pool.device], self.graphs_per_size, self.graph_max_bytes)
        except (RuntimeError, torch.OutOfMemoryError) as e:  # a gather then is an index_select
            log.warning("KV gathers of the pool on %s are not captured (%s): each move launches its own",
                        pool.device, e)
            graphs = None
        self._graphs[self._graphs_key(pool)] = graphs
        torch.cuda.synchronize(pool.device)

    @staticmethod
    def _graphs_key(pool: torch.Tensor) -> tuple:
        # The graphs read the pool by address: a pool made anew at the same address, of the
        # same layout, is read right by them; any other layout gets graphs of its own.
        return pool.data_ptr(), pool.device, tuple(pool.shape), pool.stride(), pool.dtype

    def graphs_of(self, pool: torch.Tensor) -> GatherGraphs | None:
        """The captured gathers of a device pool (None: not prepared, or none captured)."""
        return self._graphs.get(self._graphs_key(pool))

    def pack(self, pool: torch.Tensor, src_block_ids, dst_block_ids
             ) -> tuple[tuple[BlockRun, ...], tuple[torch.Tensor, ...], torch.cuda.Event | None]:
        """``(runs, buffers, ready)``: those of ``pack_kv_runs``, and for a device pool the event
        after which the buffers hold the blocks (None for a host pool: packed already)."""
        if not pool.is_cuda:
            return *pack_kv_runs(pool, src_block_ids, dst_block_ids, self.staging), None
        if self._retired:
            self._retired = [(event, graph) for event, graph in self._retired
                             if event is not None and not event.query()]
        key = self._graphs_key(pool)
        if key not in self._graphs:
            self.prepare(pool)
        runs, buffers = pack_kv_runs(pool, src_block_ids, dst_block_ids, graphs=self._graphs.get(key))
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(pool.device))
        return runs, buffers, ready

    def on_stream(self, pool: torch.Tensor) -> contextlib.AbstractContextManager:
        """A stream of this packer's, with nothing queued on it, as the current one while a
        packed message is encoded, for synchronous code only (a coroutine that awaits inside
        would hand it to every other task): a small device buffer that travels inline is copied
        to the host on the current stream, which should not be one with a step's kernels
        queued on it (the gather is done by then: its event passed)."""
        stream = self._streams.get(pool.device) if pool.is_cuda else None
        return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)

    def give_back(self, buffers: Iterable[torch.Tensor]) -> None:
        """A finished move's buffers (``HostStaging.give_back``, ``GatherGraphs.give_back``).
        A failed move's are never given back (``retire``)."""
        buffers = tuple(buffers)
        self.staging.give_back(buffers)
        for buffer in buffers:
            owner = getattr(buffer, "_gather_graph", None)
            if owner is not None:
                owner[0].give_back(buffer)

    def retire(self, buffers: Iterable[torch.Tensor], ready: torch.cuda.Event | None) -> None:
        """A failed move's buffers: their captured gathers are never lent again (UCX may still
        read a buffer), and each is kept until the device has passed ``ready``."""
        for buffer in buffers:
            owner = getattr(buffer, "_gather_graph", None)
            graph = owner[0].retire(buffer) if owner is not None else None
            if graph is not None:
                self._retired.append((ready, graph))
                log.warning("a captured gather of %d blocks is retired after a failed move (%d retired in all): "
                            "gathers it would have taken are launched as they come", graph.capacity,
                            owner[0].num_retired)

    async def send(self, transport: Transport, peer: PeerAddress, pool: torch.Tensor,
                   src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                   message_of: Callable[[tuple[BlockRun, ...], tuple[torch.Tensor, ...]], Message],
                   timeout_s: float) -> Message:
        """Pack ``src_block_ids`` of ``pool`` for ``dst_block_ids``, wait for the gather with the
        event loop turning, send ``message_of(runs, buffers)`` to ``peer`` and return its reply;
        all within ``timeout_s`` (TimeoutError while the gather is not done, the transport's
        errors after). The buffers are given back once the peer answered, never before: UCX may
        read them until then, and a failed send's are left to be freed with their last view.

        Encoded where ``request_soon`` posts at once, on ``on_stream``; where no connection is
        open yet, later, on the current stream: a small inline device buffer is then copied to
        the host behind whatever that stream holds (correct, only slower)."""
        deadline = time.monotonic() + timeout_s
        if self.map_pools and await transport.map_device_pool(peer, pool, max(0.0, deadline - time.monotonic())):
            return await self._send_rows(transport, peer, pool, src_block_ids, dst_block_ids, message_of, deadline)
        runs, buffers, ready = self.pack(pool, src_block_ids, dst_block_ids)
        try:
            await wait_for_event(ready, deadline)
            with self.on_stream(pool):
                reply_soon = transport.request_soon(peer, message_of(runs, buffers),
                                                    timeout_s=max(0.0, deadline - time.monotonic()), device_ready=True)
            reply = await reply_soon
        except RemoteError as e:
            if e.code in REFUSAL_CODES:  # the peer closes the connection, maybe before it read them
                self.retire(buffers, ready)
            else:  # it answered once every buffer had landed (or was drained, refused)
                self.give_back(buffers)
            raise
        except BaseException:
            self.retire(buffers, ready)
            raise
        self.give_back(buffers)
        return reply


    async def _send_rows(self, transport: Transport, peer: PeerAddress, pool: torch.Tensor,
                         src_block_ids: Sequence[int], dst_block_ids: Sequence[int],
                         message_of: Callable[[tuple[BlockRun, ...], tuple[PoolRows, ...]], Message],
                         deadline: float) -> Message:
        """``send`` to a peer that mapped ``pool``: one ``PoolRows`` buffer per destination run,
        sent once the kernels queued before have written the blocks (the peer reads them as
        soon as the header comes). The rows are the caller's blocks: they must not change until
        this returns, which a move's blocks never do."""
        packed = destination_runs(src_block_ids, dst_block_ids)
        runs = tuple(BlockRun(r.dst_block_id, r.num_blocks) for r in packed)
        buffers = tuple(PoolRows(pool, r.src_block_ids) for r in packed)
        stream = torch.cuda.current_stream(pool.device) if pool.is_cuda else None
        # An idle stream has written the blocks already: no event is recorded, which on one GPU
        # shared with the peer's process would be work of this process's for the GPU to turn to.
        if stream is not None and not stream.query():
            ready = torch.cuda.Event()
            ready.record(stream)
            await wait_for_event(ready, deadline)
        with self.on_stream(pool):  # rows sent gathered after all (a new connection) are gathered there
            reply_soon = transport.request_soon(peer, message_of(runs, buffers),
                                                timeout_s=max(0.0, deadline - time.monotonic()), device_ready=True)
        return await reply_soon


async def wait_for_event(event: torch.cuda.Event | None, deadline: float) -> None:
    """Until the device has passed ``event`` (None: at once), looked at between the event
    loop's other work rather than waited on with the loop blocked (a gather queued behind a
    step's kernels waits for the step); TimeoutError past ``deadline`` (time.monotonic()).
    Looking at it for 100 us with the loop held before letting it turn moved the H200's
    gathered blocks no faster, mostly slower (``docs/performance.md``)."""
    if event is None:
        return
    while not event.query():
        if time.monotonic() >= deadline:
            raise TimeoutError("device work before a move did not finish in time")
        await asyncio.sleep(0)
