"""The buffers of a KV move: one per destination run, gathered from the source pool.

A run whose source blocks are consecutive is a view of the pool (no copy); one whose sources
are scattered is gathered with one ``index_select`` on the pool's device, queued on the
current stream: the codec waits for it before UCX reads the buffer on its own streams.

``KVPacker`` packs a move as a daemon's mover does: a device pool's gathers come with an event
recorded after them, which the caller polls from its event loop (``wait_for_event``) instead
of the codec blocking the loop on a stream wait.

A gather from a host pool goes into a ``HostStaging`` buffer where the caller keeps one. A
fresh host buffer of a few MiB is fresh pages, and the gather faults every one of them in:
on the development CPU, 64 blocks of 64 KiB took 0.3-0.9 ms to gather into fresh memory
against 0.1 ms into memory gathered into before. (Device pools need none: the caching
allocator hands the same memory out again.)
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from infinite_llm.transport.block_runs import PackedRun, destination_runs
from infinite_llm.transport.interface import PeerAddress, Transport
from infinite_llm.transport.messages import BlockRun, Message


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
                 staging: HostStaging | None = None) -> tuple[tuple[BlockRun, ...], tuple[torch.Tensor, ...]]:
    """``(runs, buffers)`` for a ``KVBlocks`` message moving ``src_block_ids`` of ``pool``
    (``[num_blocks, ...]``, one block per leading index) into ``dst_block_ids``.

    ``buffers[i]``: ``[runs[i].num_blocks, *pool.shape[1:]]``, the pool's dtype and device.
    ``staging``: where gathers from a host pool go (give them back after the move).
    """
    packed: list[PackedRun] = destination_runs(src_block_ids, dst_block_ids)
    buffers = []
    for run in packed:
        if run.src_consecutive:
            first = run.src_block_ids[0]
            buffers.append(pool[first:first + run.num_blocks])
            continue
        index = _block_index(run.src_block_ids, pool.device)
        if staging is not None and pool.device.type == "cpu":
            out = staging.take((run.num_blocks, *pool.shape[1:]), pool.dtype)
            buffers.append(torch.index_select(pool, 0, index, out=out))
        else:
            buffers.append(pool.index_select(0, index))
    return tuple(BlockRun(r.dst_block_id, r.num_blocks) for r in packed), tuple(buffers)


def _block_index(block_ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``block_ids`` as an int64 tensor on ``device``, for ``index_select``: up without waiting
    for the device's queued work (a blocking copy would wait for every kernel queued on the
    stream; from pageable memory the bytes are staged before this returns). On the H200 this
    took 35 us with the device idle and 55 us with its stream busy, against 54 and 129 us
    through torch's pinned allocator. Through numpy: torch.tensor of a list of 64 ints takes
    8.6 us, this 2.8 us."""
    ids = torch.from_numpy(np.array(block_ids, dtype=np.int64))
    return ids if device.type == "cpu" else ids.to(device, non_blocking=True)


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

    def __init__(self, staging: HostStaging | None = None) -> None:
        self.staging = staging if staging is not None else HostStaging()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def prepare(self, pool: torch.Tensor) -> None:
        """Make the encoding stream for a device pool (``on_stream``) and gather some of its
        blocks once, now, while nothing is queued: making a CUDA stream, a kernel's first launch
        (CUDA loads modules lazily) and a process's first copy up from pageable memory each wait
        for the device's queued work (162 ms behind a step's kernels on the H200, for the
        stream), which the first move would otherwise do with the event loop blocked."""
        if not pool.is_cuda or pool.device in self._streams:
            return
        self._streams[pool.device] = torch.cuda.Stream(pool.device)
        # Torch gathers up to 16 indices with one kernel and more with another: both, once.
        for num_blocks in (2, 17):
            if len(pool) >= num_blocks:
                pack_kv_runs(pool, list(reversed(range(num_blocks))), list(range(num_blocks)))
        torch.cuda.synchronize(pool.device)

    def pack(self, pool: torch.Tensor, src_block_ids, dst_block_ids
             ) -> tuple[tuple[BlockRun, ...], tuple[torch.Tensor, ...], torch.cuda.Event | None]:
        """``(runs, buffers, ready)``: those of ``pack_kv_runs``, and for a device pool the event
        after which the buffers hold the blocks (None for a host pool: packed already)."""
        if not pool.is_cuda:
            return *pack_kv_runs(pool, src_block_ids, dst_block_ids, self.staging), None
        self.prepare(pool)
        runs, buffers = pack_kv_runs(pool, src_block_ids, dst_block_ids)
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
        """A finished move's buffers (``HostStaging.give_back``)."""
        self.staging.give_back(buffers)

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
        runs, buffers, ready = self.pack(pool, src_block_ids, dst_block_ids)
        await wait_for_event(ready, deadline)
        with self.on_stream(pool):
            reply_soon = transport.request_soon(peer, message_of(runs, buffers),
                                                timeout_s=max(0.0, deadline - time.monotonic()), device_ready=True)
        reply = await reply_soon
        self.give_back(buffers)
        return reply


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
