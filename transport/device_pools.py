"""KV pools that a peer on the same host reads in place: a move's blocks pulled, not sent.

A sender shares its device pool once per connection (``DevicePoolOffer``: the pool's CUDA IPC
handle, as ``torch.multiprocessing`` shares a tensor between processes); a receiver that opens
it maps the sender's pool into its own address space. From then on a buffer made of whole
rows of that pool (``PoolRows``: a move's source blocks) travels as the pool's id and the row
ids, and the receiver copies those rows straight into their destination with one kernel on a
stream of its own (``pull_rows``). Nothing is gathered on the sender and UCX moves no bytes:
on one GPU, or on two of one host with peer access, the move is one device copy.

A sender's rows must not change until the receiver has answered: a move's blocks are full
and only freed once its reply (or its failure) came. A frame whose rows the receiver cannot
read (an unknown pool id, rows out of range, sizes that disagree) is refused as any malformed
frame is. No I/O here but CUDA's own; ``pull_rows`` works on host tensors too (the in-memory
transport's peers, and tests without a GPU).
"""

from __future__ import annotations

import ctypes
import logging
import math
import re
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch

from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.graph_capture import capture
from infinite_llm.transport.messages import DevicePoolOffer, ErrorCode
from infinite_llm.transport.tensors import _TORCH_DTYPES, TORCH_DTYPE_NAMES

log = logging.getLogger(__name__)


class DevicePoolUnavailable(Exception):
    """A pool could not be shared or opened (another host, no peer access between the two
    GPUs, memory that CUDA cannot share, a malformed offer): its blocks travel over UCX."""


class PoolRows:
    """Rows ``rows`` of ``pool`` (``[num_rows, *row_shape]``, contiguous), in that order, as one
    buffer of a message: ``[len(rows), *row_shape]`` of the pool's dtype. Encoded as the rows'
    ids where the peer mapped the pool, else gathered (``gather``) and sent as their bytes."""

    __slots__ = ("pool", "rows", "shape")

    def __init__(self, pool: torch.Tensor, rows: Sequence[int]) -> None:
        if not pool.is_contiguous() or pool.dim() < 1:
            raise ValueError("a pool is a contiguous tensor of rows")
        self.pool = pool
        self.rows = tuple(int(r) for r in rows)
        if not self.rows or min(self.rows) < 0 or max(self.rows) >= len(pool):
            raise ValueError(f"rows must be 1 or more of the pool's 0..{len(pool) - 1}")
        self.shape = (len(self.rows), *pool.shape[1:])

    @property
    def dtype(self) -> torch.dtype:
        return self.pool.dtype

    @property
    def is_cuda(self) -> bool:
        return self.pool.is_cuda

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.pool.element_size()

    def gather(self) -> torch.Tensor:
        """The rows as a tensor of their own (a view where they are consecutive), queued on the
        current stream."""
        first = self.rows[0]
        if self.rows == tuple(range(first, first + len(self.rows))):
            return self.pool[first:first + len(self.rows)]
        return torch.index_select(self.pool, 0, row_index(self.rows, self.pool.device))


def row_index(rows: Sequence[int], device: torch.device) -> torch.Tensor:
    """``rows`` as an int64 tensor on ``device``, for ``index_select``: up without waiting
    for the device's queued work (a blocking copy would wait for every kernel queued on the
    stream; from pageable memory the bytes are staged before this returns). On the H200 this
    took 35 us with the device idle and 55 us with its stream busy, against 54 and 129 us
    through torch's pinned allocator. Through numpy: torch.tensor of a list of 64 ints takes
    8.6 us, this 2.8 us."""
    ids = torch.from_numpy(np.array(rows, dtype=np.int64))
    return ids if device.type == "cpu" else ids.to(device, non_blocking=True)


def export_pool(pool: torch.Tensor, pool_id: int) -> DevicePoolOffer:
    """The offer that lets a process on this host map ``pool`` (a contiguous CUDA tensor).
    Raises DevicePoolUnavailable where CUDA cannot share its memory (expandable segments)."""
    if not pool.is_cuda or not pool.is_contiguous():
        raise DevicePoolUnavailable("only a contiguous device pool is shared")
    dtype = TORCH_DTYPE_NAMES.get(pool.dtype)
    if dtype is None:
        raise DevicePoolUnavailable(f"dtype {pool.dtype} cannot travel on the wire")
    try:
        (device, handle, storage_bytes, storage_offset_bytes, ref_counter, ref_counter_offset, event,
         event_sync_required) = pool.untyped_storage()._share_cuda_()
    except RuntimeError as e:
        raise DevicePoolUnavailable(f"CUDA cannot share the pool's memory: {e}") from None
    return DevicePoolOffer(
        pool_id=pool_id, device=int(device), handle=bytes(handle).hex(), storage_bytes=int(storage_bytes),
        storage_offset_bytes=int(storage_offset_bytes), ref_counter=bytes(ref_counter).hex(),
        ref_counter_offset=int(ref_counter_offset), event=bytes(event or b"").hex(),
        event_sync_required=bool(event_sync_required), dtype=dtype, shape=tuple(pool.shape),
        offset=pool.storage_offset())


# torch's reference counters of shared CUDA memory lie in files of this many int64 counters
# (CUDA_IPC_REF_COUNTER_FILE_SIZE), named as at::NewProcessWideShmHandle names them. The mapped
# pool's deleter decrements the counter the offer names, in the file it names: an offset past
# the file's counters would write outside the mapping, and a name of another shared-memory file
# of this user would have a word of that file decremented.
REF_COUNTERS_PER_FILE = 10_000
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]+_[0-9]+_[0-9]+")


def check_offer(offer: DevicePoolOffer) -> tuple[torch.dtype, bytes, bytes, bytes | None]:
    """The offer's dtype and its handles (memory, reference counter, event) as bytes, where its
    fields are what ``offer_pool`` makes and fit one another. Raises DevicePoolUnavailable
    otherwise. No CUDA call: the checks that need the opened memory are ``open_pool``'s."""
    dtype = _TORCH_DTYPES.get(offer.dtype)
    if dtype is None:
        raise DevicePoolUnavailable(f"dtype {offer.dtype!r} is not one of {sorted(_TORCH_DTYPES)}")
    span = (offer.offset + math.prod(offer.shape)) * dtype.itemsize
    if span > offer.storage_bytes or offer.storage_bytes > (1 << 50):
        raise DevicePoolUnavailable(f"a pool of {span} bytes in memory of {offer.storage_bytes}")
    try:
        handle, ref_counter = bytes.fromhex(offer.handle), bytes.fromhex(offer.ref_counter)
        event = bytes.fromhex(offer.event) if offer.event else None
    except ValueError:
        raise DevicePoolUnavailable("the offer's handles are not hex") from None
    if not _REF_COUNTER_NAME.fullmatch(ref_counter) or not 0 <= offer.ref_counter_offset < REF_COUNTERS_PER_FILE:
        raise DevicePoolUnavailable(f"reference counter {ref_counter[:64]!r} at {offer.ref_counter_offset}: "
                                    f"not one of torch's ({REF_COUNTERS_PER_FILE} counters a file)")
    return dtype, handle, ref_counter, event


def open_pool(offer: DevicePoolOffer, device: torch.device) -> torch.Tensor:
    """The peer's pool of ``offer``, mapped here, on ``device`` (this process's GPU): a tensor
    of the offer's shape and dtype over the peer's memory. Raises DevicePoolUnavailable where
    it cannot be opened on that device (another host, no peer access) or does not fit in the
    memory the offer names."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise DevicePoolUnavailable("this process receives into host memory")
    dtype, handle, ref_counter, event = check_offer(offer)
    # Opened under this process's own device, whichever GPU the pool is on: CUDA maps another
    # GPU's memory into this device's context where the two have peer access (NVLink), and the
    # copies then run here, reading it; it refuses where they have none.
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        torch.cuda._lazy_init()
        with torch.cuda.device(index):
            storage = torch.UntypedStorage._new_shared_cuda(
                index, handle, offer.storage_bytes, offer.storage_offset_bytes, ref_counter,
                offer.ref_counter_offset, event, offer.event_sync_required)
            # The offer's sizes are the peer's word: a storage that runs past the memory the
            # handle maps would let a copy fault this process's device context, or read memory
            # of this process's own. Torch maps the handle at its allocation's base and puts
            # the storage the offset past it, so that base must be the allocation's, and the
            # offset and size must fit in it.
            mapped_at = storage.data_ptr() - offer.storage_offset_bytes
            base, size = allocation_range(storage.data_ptr())
            if base != mapped_at or offer.storage_offset_bytes + offer.storage_bytes > size:
                raise DevicePoolUnavailable(
                    f"the offer names {offer.storage_bytes} bytes {offer.storage_offset_bytes} past the start "
                    f"of memory its handle maps {size} bytes of")
            pool = torch.empty(0, dtype=dtype, device=device)
            pool.set_(storage, offer.offset, offer.shape)
    except (RuntimeError, TypeError) as e:  # CUDA's refusal (another host, no peer access)
        raise DevicePoolUnavailable(f"CUDA cannot open the peer's pool: {e}") from None
    return pool


_libcuda: ctypes.CDLL | None = None


def allocation_range(pointer: int) -> tuple[int, int]:
    """The base and the size in bytes of the device allocation that holds ``pointer`` (of the
    current device's context): the driver's ``cuMemGetAddressRange``, which the CUDA runtime
    does not expose. Raises DevicePoolUnavailable where the driver does not know the pointer."""
    global _libcuda
    if _libcuda is None:
        try:
            libcuda = ctypes.CDLL("libcuda.so.1")
            function = libcuda.cuMemGetAddressRange_v2
        except (OSError, AttributeError) as e:
            raise DevicePoolUnavailable(f"the CUDA driver cannot tell an allocation's range: {e}") from None
        function.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        function.restype = ctypes.c_int
        _libcuda = libcuda
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    if status != 0:
        raise DevicePoolUnavailable(f"the driver knows no allocation at {pointer:#x} (CUresult {status})")
    return base.value, size.value


_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def row_words(pool: torch.Tensor) -> torch.Tensor:
    """``pool`` as ``[num_rows, words]`` of the widest integer type that divides a row (a view):
    a gather moves one element a thread, and on rows of bytes it took eight times the threads
    of rows of 8-byte words."""
    flat = pool.view(torch.uint8).view(len(pool), -1)
    for word in _WORDS:
        if flat.shape[1] % word.itemsize == 0 and flat.data_ptr() % word.itemsize == 0:
            return flat.view(word)
    return flat


def row_nbytes(source_rows: torch.Tensor) -> int:
    """Bytes in a row of ``row_words``."""
    return source_rows.shape[1] * source_rows.element_size()


def pool_key(pool) -> tuple:
    """What tells one shared pool from another: its memory and layout."""
    return pool.data_ptr(), pool.device, tuple(pool.shape), pool.dtype


_MISSING = object()


class SharedPools:
    """Something kept per shared pool (its offer, the id a peer mapped it under), by the pool's
    key and its storage, held weakly: a pool freed and another made at the same address with
    the same layout is another pool, whose memory a peer's mapping of the first may not be
    (CUDA gives memory freed back to the driver a new IPC handle)."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, tuple[object, weakref.ref]] = {}

    def get(self, pool, default=None):
        """What was kept for ``pool``'s storage, ``default`` where nothing was or the storage
        kept for its key is gone."""
        entry = self._by_key.get(pool_key(pool))
        if entry is None or entry[1]() is not pool.untyped_storage():
            return default
        return entry[0]

    def put(self, pool, value) -> None:
        self._by_key[pool_key(pool)] = (value, weakref.ref(pool.untyped_storage()))

    def __contains__(self, pool) -> bool:
        return self.get(pool, _MISSING) is not _MISSING

    def __len__(self) -> int:
        return len(self._by_key)

    def values(self) -> list:
        """What is kept for pools whose storage lives."""
        return [value for value, storage in self._by_key.values() if storage() is not None]


def check_rows(source_rows: torch.Tensor | None, pool_id: int, rows: Sequence[int], destination_nbytes: int) -> None:
    """Refuse (ProtocolError, as a malformed frame) rows of a pool never mapped (``source_rows``
    None), past its end, or of another size than their destination, before any copy."""
    if source_rows is None:
        raise ProtocolError(ErrorCode.INVALID_FIELDS, f"rows of pool {pool_id}, never mapped here")
    if max(rows) >= len(source_rows):
        raise ProtocolError(ErrorCode.INVALID_FIELDS,
                            f"row {max(rows)} of pool {pool_id}, which has {len(source_rows)}")
    if len(rows) * row_nbytes(source_rows) != destination_nbytes:
        raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"{len(rows)} rows of {row_nbytes(source_rows)} bytes "
                                                       f"for a {destination_nbytes}-byte buffer")


def pull_rows(source_rows: torch.Tensor, rows: Sequence[int], destination: torch.Tensor,
              index: Callable[[Sequence[int]], torch.Tensor] | None = None) -> torch.Tensor | None:
    """Copy rows ``rows`` of ``source_rows`` (``[num_rows, words]``, ``row_words``) into
    ``destination`` (a contiguous tensor of ``len(rows) * row_nbytes`` bytes), queued on the
    current stream. Returns what must live until the copy has run (the device's row ids),
    None where nothing must. Consecutive rows are one copy, others one gather, whose ids on
    the source's device ``index`` makes (``PullSlot.index``, from pinned memory: from pageable
    memory the copy returns only once it ran, which on a GPU that takes turns with the sender's
    process holds the event loop for that turn; by default ``row_index``)."""
    count = len(rows)
    out = destination.reshape(-1).view(torch.uint8)
    try:
        out = out.view(source_rows.dtype).view(count, source_rows.shape[1])
    except RuntimeError:  # a destination off the words' alignment: both as bytes
        source_rows = source_rows.view(torch.uint8).view(len(source_rows), -1)
        out = out.view(count, source_rows.shape[1])
    first = rows[0]
    if tuple(rows) == tuple(range(first, first + count)):
        out.copy_(source_rows[first:first + count], non_blocking=True)
        return None
    ids = index(rows) if index is not None else row_index(rows, source_rows.device)
    if out.device == source_rows.device:
        torch.index_select(source_rows, 0, ids, out=out)
    else:
        out.copy_(torch.index_select(source_rows, 0, ids), non_blocking=True)
    return ids


class PullSlot:
    """What one frame's pulls on a device use, made once and used again: row ids in pinned
    host memory and on the device (copied up without the host waiting), and the event after
    the frame's copies. Torch's pinned allocator and a fresh event cost each pull several
    driver calls more."""

    def __init__(self, device: torch.device, capacity: int) -> None:
        self.capacity = capacity
        self._pinned = torch.empty(capacity, dtype=torch.int64, pin_memory=True)
        self._pinned_numpy = self._pinned.numpy()
        self._ids = torch.empty(capacity, dtype=torch.int64, device=device)
        self._used = 0
        self.event = torch.cuda.Event()

    def index(self, rows: Sequence[int]) -> torch.Tensor:
        """``rows`` on the device, queued on the current stream (``pull_rows``' ``index``)."""
        start, stop = self._used, self._used + len(rows)
        self._pinned_numpy[start:stop] = rows
        ids = self._ids[start:stop]
        ids.copy_(self._pinned[start:stop], non_blocking=True)
        self._used = stop
        return ids


class PullSlots:
    """A device's ``PullSlot``s: one is taken per frame, and given back once the device has
    passed its event. A failed frame's slot is retired instead, with what its copies read and
    write (the peer's mapped pool, the destinations), until the device has passed its event:
    freed or unmapped earlier, that memory could be handed out while its copies are queued. A
    failed frame's ``PullGraph`` is kept here the same way (it holds what it touches)."""

    def __init__(self, device: torch.device, max_free: int = 8) -> None:
        self.device = device
        self.max_free = max_free
        self._free: list[PullSlot] = []
        self._retired: list[tuple[PullSlot, object]] = []

    def retire(self, slot: PullSlot, keep: object) -> None:
        self._retired.append((slot, keep))

    @property
    def num_retired(self) -> int:
        return len(self._retired)

    def prune(self) -> None:
        """Let go of the retired slots (and graphs) the device has passed."""
        if self._retired:
            self._retired = [(slot, keep) for slot, keep in self._retired if not slot.event.query()]

    def take(self, num_rows: int) -> PullSlot:
        """A slot for ``num_rows`` row ids. Call it with the stream the copies run on as the
        current one: a new slot's device ids are allocated there, so that their memory goes
        back to that stream's pool."""
        self.prune()
        fits = [slot for slot in self._free if slot.capacity >= num_rows]
        if fits:
            slot = min(fits, key=lambda s: s.capacity)
            self._free.remove(slot)
            slot._used = 0
            return slot
        return PullSlot(self.device, max(1024, 1 << (num_rows - 1).bit_length()))

    def give_back(self, slot: PullSlot) -> None:
        if len(self._free) < self.max_free:
            self._free.append(slot)


# Pulls replayed from captured graphs (``PullGraphs``). A captured pull copies its rows through
# a buffer of its own (at most this many bytes), and each shape has at most this many graphs
# (the frames a connection lands at once); a connection keeps at most this many in all, beyond
# which a pull is launched as before.
PULL_GRAPH_MAX_BYTES = 16 << 20
PULL_GRAPHS_PER_SHAPE = 4
PULL_GRAPHS_PER_CONNECTION = 32
# A destination is taken for rows of a pool (kept while its graphs are) only where its storage
# holds this many times the rows a graph copies: a buffer allocated for one frame never is.
PULL_GRAPH_MIN_POOL_FACTOR = 4


def destination_rows_of(destination: torch.Tensor, source_rows: torch.Tensor) -> tuple[tuple, int] | None:
    """Where ``destination`` lies as whole rows of its storage, the storage seen as rows of
    ``source_rows`` (``[num_rows, words]``): ((storage's address, its bytes, the rows' phase
    in bytes, row bytes, word dtype), the destination's first row); None where it is not a
    contiguous tensor on the rows' device, or does not start on a row that the words line up
    with."""
    if (not isinstance(destination, torch.Tensor) or destination.device != source_rows.device
            or not destination.is_contiguous()):
        return None
    storage = destination.untyped_storage()
    row_bytes = row_nbytes(source_rows)
    address = storage.data_ptr()
    offset = destination.data_ptr() - address
    phase = offset % row_bytes
    if (address + phase) % source_rows.element_size():
        return None
    return (address, storage.nbytes(), phase, row_bytes, source_rows.dtype), offset // row_bytes


def pull_capacity(num_rows: int) -> int:
    """The rows a graph for a pull of ``num_rows`` copies: the next power of two (from 2)."""
    return max(2, 1 << (num_rows - 1).bit_length())


class PullGraph:
    """One captured pull: up to ``capacity`` rows of a mapped pool (``source_rows``,
    ``[num_rows, words]``) copied to rows of a pool of this process (``destination_rows``, the
    same row size), gathered into a buffer of the graph's own and scattered from it.

    A pull of n <= capacity rows writes the source and destination row ids into pinned memory
    (``load``) and replays the graph (the ids copied up, the gather, the scatter) on the current
    stream, then records ``event`` (``replay``): four launches and the ids' copy of an eager
    pull become one launch. The ids past n repeat the last pair, so that row is copied again
    with the same bytes; no other row is touched. It may be loaded again once the device has
    passed ``event`` (the replay reads the pinned ids). Holds both pools while it lives.
    Raises what ``graph_capture.capture`` raises where the capture fails.
    """

    def __init__(self, source_rows: torch.Tensor, destination_rows: torch.Tensor, capacity: int,
                 memory_pool: tuple[int, int], key: tuple = ()) -> None:
        self.capacity = capacity
        self.key = key  # its PullGraphs' key for it
        self.source_rows, self.destination_rows = source_rows, destination_rows  # read by address
        ids_host = torch.zeros((2, capacity), dtype=torch.int64, pin_memory=True)
        self._ids_host = ids_host
        self._ids = ids_host.numpy()
        ids_device = torch.zeros((2, capacity), dtype=torch.int64, device=source_rows.device)
        self._ids_device = ids_device
        self.event = torch.cuda.Event()
        self.graph = torch.cuda.CUDAGraph()

        def body() -> None:
            ids_device.copy_(ids_host, non_blocking=True)
            gathered = torch.index_select(source_rows, 0, ids_device[0])
            destination_rows.index_copy_(0, ids_device[1], gathered)
        capture(self.graph, memory_pool, body)

    def load(self, source_ids: np.ndarray, destination_ids: np.ndarray) -> None:
        """The rows the next replay copies: ``source_ids`` to ``destination_ids`` (as many, 1
        to ``capacity``)."""
        n = len(source_ids)
        ids = self._ids
        ids[0, :n] = source_ids
        ids[0, n:] = source_ids[-1]
        ids[1, :n] = destination_ids
        ids[1, n:] = destination_ids[-1]

    def replay(self) -> None:
        """Copy the loaded rows, queued on the current stream, and record ``event`` after."""
        self.graph.replay()
        self.event.record()


class PullGraphs:
    """A connection's captured pulls (``PullGraph``), by source pool, destination pool and
    size; each free, or lent to one frame until the device passed its event.

    A frame is pulled this way where all its rows come from one mapped pool and land in whole
    rows of one storage that is a pool (``PULL_GRAPH_MIN_POOL_FACTOR``), in places that do not
    overlap, and a graph is free or may be made; else ``lend`` returns None and the frame's
    rows are copied eagerly (``pull_rows``), as they are where they are one run of consecutive
    rows (one copy, without ids). A graph is made the first time its shape is needed, in a few
    milliseconds of host time: the kernels it replays run once eagerly first (on that frame's
    first row, which the graph then copies again), as capture asks. At the limit of graphs, the
    free graph used least recently goes; a capture that fails turns the graphs off.

    The graphs of a connection share one memory pool: each writes its gathered rows into
    memory of that pool, and they all run on the device's one pull stream, one after another,
    so none writes it while another reads it.
    """

    def __init__(self, max_graphs: int = PULL_GRAPHS_PER_CONNECTION, per_shape: int = PULL_GRAPHS_PER_SHAPE,
                 max_bytes: int = PULL_GRAPH_MAX_BYTES) -> None:
        self.max_graphs = max_graphs
        self.per_shape = per_shape
        self.max_bytes = max_bytes
        # Free graphs by key, the key used last at the end (the first one is evicted first).
        self._free: OrderedDict[tuple, list[PullGraph]] = OrderedDict()
        self._made: dict[tuple, int] = {}  # graphs of each key, free or lent
        self._memory_pool: tuple[int, int] | None = None
        self.num_made = 0
        self.off = False  # a capture failed: every pull is launched eagerly from then on

    def lend(self, sources: Sequence[torch.Tensor], pulls: Sequence[tuple[torch.Tensor, int, Sequence[int]]]) -> PullGraph | None:
        """A graph loaded with a frame's pulls, (destination, pool id, row ids) with the source
        rows of each (``[num_rows, words]``, ``sources``), to ``replay`` on the pull stream and
        ``give_back`` once the device passed its event (``retire`` where the frame failed); None
        where the frame cannot be pulled this way. Call it with the pull stream current: a graph
        made here is captured on it."""
        source_rows, pool_id = sources[0], pulls[0][1]
        if self.off or not source_rows.is_cuda or any(other is not source_rows for other in sources[1:]):
            return None
        if len(pulls) == 1:
            rows = pulls[0][2]
            if tuple(rows) == tuple(range(rows[0], rows[0] + len(rows))):
                return None  # one copy, no ids: cheaper launched
        where = [destination_rows_of(destination, source_rows) for destination, _pool_id, _rows in pulls]
        storage_key = where[0][0] if where[0] is not None else None
        if storage_key is None or any(w is None or w[0] != storage_key for w in where[1:]):
            return None
        if len(pulls) > 1:  # rows written twice would land in an order a graph does not keep
            spans = sorted((first, first + len(rows)) for (_key, first), (_d, _p, rows) in zip(where, pulls))
            if any(start < end for (_start, end), (start, _end) in zip(spans, spans[1:])):
                return None
        _address, storage_bytes, phase, row_bytes, _dtype = storage_key
        num_rows = sum(len(rows) for _destination, _pool_id, rows in pulls)
        capacity = pull_capacity(num_rows)
        storage_rows = (storage_bytes - phase) // row_bytes
        if capacity * row_bytes > self.max_bytes or storage_rows < PULL_GRAPH_MIN_POOL_FACTOR * capacity:
            return None
        key = (pool_id, storage_key, capacity)
        free = self._free.get(key)
        if free:
            graph = free.pop()
            self._free.move_to_end(key)
        else:
            graph = self._make(key, source_rows, pulls[0][0], where[0][1], pulls[0][2][0])
            if graph is None:
                return None
        source_ids = np.empty(num_rows, dtype=np.int64)
        destination_ids = np.empty(num_rows, dtype=np.int64)
        at = 0
        for (_destination, _pool_id, rows), (_key, first_row) in zip(pulls, where):
            source_ids[at:at + len(rows)] = rows
            destination_ids[at:at + len(rows)] = np.arange(first_row, first_row + len(rows))
            at += len(rows)
        graph.load(source_ids, destination_ids)
        return graph

    def _make(self, key: tuple, source_rows: torch.Tensor, destination: torch.Tensor,
              first_destination_row: int, first_source_row: int) -> PullGraph | None:
        if self._made.get(key, 0) >= self.per_shape or (self.num_made >= self.max_graphs and not self._evict()):
            return None
        _pool_id, (_address, storage_bytes, phase, row_bytes, dtype), capacity = key
        storage = destination.untyped_storage()
        destination_rows = torch.empty(0, dtype=dtype, device=destination.device)
        destination_rows.set_(storage, phase // dtype.itemsize,
                              ((storage_bytes - phase) // row_bytes, row_bytes // dtype.itemsize))
        # The kernels run once before they are captured (lazy loading and initialisation), with
        # as many ids as the replays (the kernels chosen depend on it): here the frame's first
        # row, which the replay then copies again.
        try:
            ids = row_index([first_source_row] * capacity + [first_destination_row] * capacity, source_rows.device)
            destination_rows.index_copy_(0, ids[capacity:], torch.index_select(source_rows, 0, ids[:capacity]))
        except RuntimeError as e:  # out of memory, say: this frame is pulled eagerly
            log.warning("a pull of %d rows could not run before its capture: %s", capacity, e)
            return None
        if self._memory_pool is None:
            self._memory_pool = torch.cuda.graph_pool_handle()
        try:
            graph = PullGraph(source_rows, destination_rows, capacity, self._memory_pool, key)
        except Exception as e:  # noqa: BLE001  (the frame and all after it are pulled eagerly)
            log.warning("a pull of %d rows could not be captured, pulls are launched from now on: %s", capacity, e)
            self.off = True
            return None
        self._made[key] = self._made.get(key, 0) + 1
        self.num_made += 1
        return graph

    def _evict(self) -> bool:
        """Drop the free graph used least recently (the device has passed it); False where
        every graph is lent."""
        for key, graphs in self._free.items():
            if graphs:
                graphs.pop()
                if not graphs:
                    del self._free[key]
                self._made[key] -= 1
                self.num_made -= 1
                return True
        return False

    def give_back(self, graph: PullGraph) -> None:
        """``graph`` free again (the device has passed its event)."""
        self._free.setdefault(graph.key, []).append(graph)
        self._free.move_to_end(graph.key)

    def retire(self, graph: PullGraph) -> None:
        """``graph``, of a failed frame, is lent no more (its replay may still be queued: the
        caller keeps it until the device passed its event); another may be made in its place."""
        self._made[graph.key] -= 1
        self.num_made -= 1
