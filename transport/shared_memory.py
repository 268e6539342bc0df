"""Host buffers between the processes of one host, through a file in shared memory.

UCX carries host buffers between two local processes over TCP loopback: its own shared memory
transports leave out endpoints with peer error handling (every ucxx endpoint has it), and the
option that lets them in (``MM_ERROR_HANDLING``) can wedge a receiver whose sender was killed
mid-transfer (``docs/transport.md``). This path keeps UCX for the frame's header and moves the
bulk through a file in shared memory:

- Each transport that sends requests owns one ``SharedRegion``: a file in ``/dev/shm``, sized
  up front (sparse) and committed with ``posix_fallocate`` as it is used, so that a full tmpfs
  shows as an allocation that fails (the buffer then travels over UCX), never as a SIGBUS.
- On a new connection it offers the region (``SharedMemoryOffer``: file name and a nonce
  written in the file's first page). A receiver that can open the file (a regular file of its
  own user) and finds the nonce is on the same host and shares its ``/dev/shm``; it maps the
  file read-only and answers Ack. It reads only what the owner has committed (a figure the
  owner keeps in the first page): a hole would take a page on the read fault.
- A request's host buffer that is not inline goes as an offset into the region: copied into a
  slot there (freed when the reply comes), or, where it lies in the region already (a staging
  buffer the caller took from it), with no copy. The receiver copies it into its destination.
- A region's file is removed by ``close``, else when the region is collected or the
  interpreter exits. A killed sender leaves its file, which the receiver still reads safely (the
  mapping outlives the file's name); the owner holds an flock on its file while it lives, and
  ``remove_stale_regions`` (run by each new region, and by a transport when it starts) removes
  the files whose owner is gone.

No UCX here: the region, its slots and a peer's mapping.
"""

from __future__ import annotations

import bisect
import collections
import concurrent.futures
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable

import numpy as np
import torch

from infinite_llm.transport.tensors import is_cuda, nbytes_of, wire_view

log = logging.getLogger(__name__)

HEADER_BYTES = 4096  # the region's first page: its nonce; slots start after it
SLOT_ALIGNMENT = 4096  # slots start on page boundaries, bytes
COMMIT_STEP_BYTES = 64 << 20  # the region is committed in steps of this many bytes
NONCE_BYTES = 16
_REGION_NAME = re.compile(r"infllm-(\d{1,10})-([0-9a-f]{16})\Z")
# A region's file while its owner makes it (left so by an owner killed then): swept as well,
# once it is MAKING_GRACE_S old (until its owner locks it, a sweep elsewhere could take it).
_MAKING_NAME = re.compile(r"\.infllm-(\d{1,10})-([0-9a-f]{16})\Z")
MAKING_GRACE_S = 10.0


class ParallelCopy:
    """Copies of large host buffers split over a few threads: one thread streams 5-8 GB/s on
    the H200 machine's host, four moved 11-15 GB/s. numpy lets go of the GIL while it copies.
    ``threads`` <= 1: one plain copy."""

    MIN_CHUNK_BYTES = 1 << 20  # no thread gets less

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = (concurrent.futures.ThreadPoolExecutor(self.threads - 1, thread_name_prefix="infllm-copy")
                      if self.threads > 1 else None)

    def __call__(self, destination: np.ndarray, source: np.ndarray) -> None:
        """Copy flat uint8 ``source`` into ``destination`` (same length), in page-aligned parts,
        one per thread (this one included); returns when done."""
        nbytes = destination.nbytes
        parts = min(self.threads, nbytes // self.MIN_CHUNK_BYTES)
        if self._pool is None or parts <= 1:
            np.copyto(destination, source)
            return
        bounds = [nbytes * i // parts // SLOT_ALIGNMENT * SLOT_ALIGNMENT for i in range(parts)] + [nbytes]
        others = [self._pool.submit(np.copyto, destination[a:b], source[a:b])
                  for a, b in zip(bounds[1:-1], bounds[2:])]
        np.copyto(destination[:bounds[1]], source[:bounds[1]])  # this thread copies the first part
        for part in others:
            part.result()


def default_copy_threads() -> int:
    """Threads a copy may use: a quarter of this process's CPUs, at most 4 (the engine and
    the event loop need the rest)."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 4))


class SharedMemoryUnavailable(Exception):
    """A peer's region cannot be used (another host, another user, a stale or foreign file)."""


class SlotAllocator:
    """First-fit allocation of slots in ``[start, start + capacity)``, freed slots coalesced.

    Pure bookkeeping, no memory: offsets and sizes in bytes, every slot a multiple of
    ``alignment`` long and aligned to it (``start`` is aligned by the caller).
    """

    def __init__(self, start: int, capacity: int, alignment: int = SLOT_ALIGNMENT) -> None:
        if alignment <= 0 or start % alignment or capacity < 0:
            raise ValueError(f"bad region: start {start}, capacity {capacity}, alignment {alignment}")
        self.alignment = alignment
        self._free_offsets: list[int] = [start] if capacity >= alignment else []  # sorted
        self._free_sizes: dict[int, int] = {start: capacity - capacity % alignment} if self._free_offsets else {}
        self._used: dict[int, int] = {}  # offset -> slot size

    def allocate(self, nbytes: int) -> int | None:
        """The offset of a new slot of at least ``nbytes`` (at least one alignment unit), or
        None where no free range is large enough."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        size = max(self.alignment, -(-nbytes // self.alignment) * self.alignment)
        for i, offset in enumerate(self._free_offsets):
            free = self._free_sizes[offset]
            if free < size:
                continue
            del self._free_sizes[offset]
            if free == size:
                del self._free_offsets[i]
            else:
                self._free_offsets[i] = offset + size
                self._free_sizes[offset + size] = free - size
            self._used[offset] = size
            return offset
        return None

    def free(self, offset: int) -> None:
        """Give a slot back; its range joins the free ranges beside it."""
        size = self._used.pop(offset)  # KeyError: not a slot
        i = bisect.bisect_left(self._free_offsets, offset)
        if i < len(self._free_offsets) and offset + size == self._free_offsets[i]:
            size += self._free_sizes.pop(self._free_offsets.pop(i))  # joins the range after
        if i > 0:
            before = self._free_offsets[i - 1]
            if before + self._free_sizes[before] == offset:
                self._free_sizes[before] += size  # joins the range before
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    def slot_end(self, offset: int) -> int:
        return offset + self._used[offset]

    @property
    def bytes_in_use(self) -> int:
        return sum(self._used.values())

    @property
    def num_slots(self) -> int:
        return len(self._used)

    @property
    def free_ranges(self) -> list[tuple[int, int]]:
        """(offset, size) of each free range, in order of offset."""
        return [(o, self._free_sizes[o]) for o in self._free_offsets]


class SharedRegion:
    """This process's region: a file in ``directory`` mapped read-write.

    ``max_bytes`` is its size (sparse); it is committed in steps as slots reach further. Used
    from its transport's event loop; a slot of ``host_buffer`` is freed by the garbage collector,
    on whichever thread drops the last view, so the slots are kept under a lock. The collector
    may run on a thread that holds the lock (inside ``allocate``), so a collected slot is only
    queued (``_collected``) and freed under the lock by the next call that takes it.
    """

    def __init__(self, directory: str = "/dev/shm", max_bytes: int = 1 << 30,
                 copy: ParallelCopy | None = None) -> None:
        if max_bytes < HEADER_BYTES + SLOT_ALIGNMENT:
            raise ValueError(f"a region needs at least {HEADER_BYTES + SLOT_ALIGNMENT} bytes")
        remove_stale_regions(directory)
        self.name = f"infllm-{os.getpid()}-{secrets.token_hex(8)}"
        self.path = os.path.join(directory, self.name)
        self.max_bytes = max_bytes - max_bytes % SLOT_ALIGNMENT
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        # Made under a name the sweep of stale regions passes over, locked, then renamed: a
        # sweep in another process never finds this file unlocked.
        making = os.path.join(directory, f".{self.name}")
        fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives
            os.ftruncate(fd, self.max_bytes)
            os.posix_fallocate(fd, 0, HEADER_BYTES)
            # The first page: the nonce, then the bytes committed so far (u64, little-endian),
            # beyond which a peer reads nothing.
            os.pwrite(fd, self.nonce + HEADER_BYTES.to_bytes(8, "little"), 0)
            self._map = mmap.mmap(fd, self.max_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            os.rename(making, self.path)
        except BaseException:
            os.close(fd)
            _unlink_quietly(making)
            raise
        self._fd = fd
        # The file goes with the region: at ``close``, or once the region is collected or the
        # interpreter exits without it (a daemon that returns without closing its transport).
        # Only by this process: a child forked from it inherits the finalizer, not the file.
        self._remove = weakref.finalize(self, _remove_region, self.path, fd, os.getpid())
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._base = self._bytes.ctypes.data
        self._allocator = SlotAllocator(HEADER_BYTES, self.max_bytes - HEADER_BYTES)
        self._lock = threading.Lock()
        self._collected: collections.deque[int] = collections.deque()  # appended without the lock
        self._committed = HEADER_BYTES
        self._committed_figure = self._bytes[NONCE_BYTES:NONCE_BYTES + 8].view("<u8")
        self._warned_full = False
        self._copy = copy or ParallelCopy(1)
        self.closed = False

    def allocate(self, nbytes: int) -> int | None:
        """A slot of ``nbytes``, committed; None where the region or the tmpfs is full."""
        if self.closed:
            return None
        with self._lock:
            self._free_collected()
            offset = self._allocator.allocate(nbytes)
            if offset is None:
                return None
            end = offset + nbytes
            if end > self._committed and not self._commit(end):
                self._allocator.free(offset)
                return None
            return offset

    def _commit(self, end: int) -> bool:
        """Commit the region up to at least ``end``: a step further where the tmpfs has room,
        else only what is needed (a container's /dev/shm may be 64 MiB in all)."""
        needed = -(-end // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        stepped = min(self.max_bytes, -(-end // COMMIT_STEP_BYTES) * COMMIT_STEP_BYTES)
        error: OSError | None = None
        for target in dict.fromkeys((stepped, needed)):
            try:
                os.posix_fallocate(self._fd, self._committed, target - self._committed)
            except OSError as e:
                error = e
                continue
            self._committed = target
            self._committed_figure[0] = target  # before any frame names the new slots
            return True
        if not self._warned_full:
            self._warned_full = True
            log.warning("shared memory %s: cannot commit %d bytes (%s); buffers that do not fit "
                        "travel over UCX", self.path, needed, error)
        return False

    def free(self, offset: int) -> None:
        with self._lock:
            self._free_collected()
            self._allocator.free(offset)

    def _free_collected(self) -> None:
        """Free the slots the collector released (the caller holds the lock)."""
        collected = self._collected
        while collected:
            self._allocator.free(collected.popleft())

    def view(self, offset: int, nbytes: int) -> np.ndarray:
        """The writable bytes ``[offset, offset + nbytes)`` of the region."""
        return self._bytes[offset:offset + nbytes]

    def host_buffer(self, nbytes: int) -> torch.Tensor | None:
        """A flat uint8 host tensor on a new slot: a request's buffer that lies in it goes to a
        local peer with no copy. The slot is freed once no tensor or view of this memory is
        left. None where the region is full."""
        offset = self.allocate(nbytes)
        if offset is None:
            return None
        array = self.view(offset, nbytes)
        # torch's storage keeps the numpy array alive while any view of the tensor lives. The
        # collector may free it on a thread inside ``allocate``: it only queues the slot.
        weakref.finalize(array, self._collected.append, offset)
        return torch.from_numpy(array)

    def offset_of(self, array: object) -> int | None:
        """The offset of a C-contiguous host array that lies wholly in the region's slots."""
        if isinstance(array, torch.Tensor):
            if array.is_cuda or not array.is_contiguous():
                return None
            address, nbytes = array.data_ptr(), array.numel() * array.element_size()
        elif isinstance(array, np.ndarray):
            if not array.flags.c_contiguous:
                return None
            address, nbytes = array.ctypes.data, array.nbytes
        else:
            return None
        offset = address - self._base
        if HEADER_BYTES <= offset and offset + nbytes <= self._committed:
            return offset
        return None

    def copy_in(self, array: object) -> int | None:
        """A new slot holding the bytes of host ``array``; None where full."""
        nbytes = nbytes_of(array)
        source = wire_view(array)  # raises for a non-contiguous array: before a slot is taken
        offset = self.allocate(nbytes)
        if offset is None:
            return None
        try:
            self._copy(self.view(offset, nbytes), source.numpy() if isinstance(source, torch.Tensor) else source)
        except BaseException:
            self.free(offset)
            raise
        return offset

    @property
    def bytes_in_use(self) -> int:
        with self._lock:
            self._free_collected()
            return self._allocator.bytes_in_use

    @property
    def committed_bytes(self) -> int:
        return self._committed

    def close(self) -> None:
        """Remove the file. Peers' mappings stay valid; so does this process's, while views of
        it live (an mmap with views cannot be closed)."""
        if self.closed:
            return
        self.closed = True
        self._remove()


class PeerRegion:
    """A peer's region, mapped read-only.

    Reads stay within what the owner has committed (the figure it keeps in the first page):
    a hole past it would take a page on the read fault, and a SIGBUS where the tmpfs is full. A
    process of the same user that cuts the file short could still fault the reader; such a
    process can do worse to it anyway (signal it, trace it), and no other user can open the file.
    """

    def __init__(self, name: str, mapped: mmap.mmap, copy: ParallelCopy | None = None) -> None:
        self.name = name
        self._map = mapped
        data = np.frombuffer(mapped, dtype=np.uint8)
        # The bytes and the owner's committed figure, in one attribute: a copy on a thread reads
        # both at once, whatever ``close`` does meanwhile.
        self._state: tuple[np.ndarray, np.ndarray] | None = (data, data[NONCE_BYTES:NONCE_BYTES + 8].view("<u8"))
        self.nbytes = len(mapped)
        self._copy = copy or ParallelCopy(1)

    @classmethod
    def open(cls, directory: str, name: str, nonce_hex: str, copy: ParallelCopy | None = None) -> PeerRegion:
        """Map the region ``name`` of ``directory`` if it is a regular file of this user whose
        first bytes are the nonce. Raises SharedMemoryUnavailable otherwise."""
        fd, nonce = open_offered_file(directory, name, nonce_hex, os.O_RDONLY, name_form=_REGION_NAME,
                                      what="region", unavailable=SharedMemoryUnavailable)
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_BYTES + SLOT_ALIGNMENT or os.pread(fd, NONCE_BYTES, 0) != nonce:
                raise SharedMemoryUnavailable(f"{name}: another region under that name")
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except (OSError, ValueError) as e:  # ValueError: the file was cut short meanwhile
            raise SharedMemoryUnavailable(f"cannot map {name}: {e}") from None
        finally:
            os.close(fd)
        return cls(name, mapped, copy)

    def read(self, offset: int, nbytes: int) -> np.ndarray | None:
        """The read-only bytes ``[offset, offset + nbytes)``; None where they are not wholly
        in the slots the owner committed, or the region was let go."""
        state = self._state
        if state is None:
            return None
        data, committed = state
        if offset < HEADER_BYTES or nbytes < 0 or offset + nbytes > min(self.nbytes, int(committed[0])):
            return None
        return data[offset:offset + nbytes]

    def copy_to(self, destination_view: object, offset: int, nbytes: int) -> bool:
        """Copy ``[offset, offset + nbytes)`` into a byte view (host or device); False where
        the range is not in the region's committed slots."""
        source = self.read(offset, nbytes)
        if source is None:
            return False
        if isinstance(destination_view, torch.Tensor) and not destination_view.is_cuda:
            destination_view = destination_view.numpy()
        if isinstance(destination_view, np.ndarray):
            self._copy(destination_view, source)
        elif isinstance(destination_view, torch.Tensor):
            # On the destination's own device (a copy thread's current device is not the
            # daemon's), from a private copy: torch warns of writes to a read-only array.
            destination_view.copy_(torch.from_numpy(source.copy()))
        elif is_cuda(destination_view):  # cupy
            device = torch.device("cuda", destination_view.device.id)
            torch.as_tensor(destination_view, device=device).copy_(torch.from_numpy(source.copy()))
        else:
            raise TypeError(f"cannot land in a {type(destination_view).__name__}")
        return True

    def close(self) -> None:
        """Let the mapping go: unmapped now, or with the last view of it (a copy on a thread)."""
        self._state = None
        try:
            self._map.close()
        except BufferError:
            pass  # a view of it lives on; unmapped with it


def open_offered_file(directory: str, name: str, nonce_hex: str, flags: int, *, name_form: re.Pattern[str],
                      what: str, unavailable: type[Exception]) -> tuple[int, bytes]:
    """A descriptor (opened with ``flags``) of the file ``name`` of ``directory`` that a peer
    offered, and the nonce it offered with it (``nonce_hex``), where ``name`` has the form
    ``name_form``, the nonce is NONCE_BYTES bytes in hex and the file is a regular file of
    this user.
    Raises ``unavailable`` otherwise, its message calling the file a ``what``."""
    if not isinstance(name, str) or not name_form.match(name):
        raise unavailable(f"not a {what} name: {name!r:.80}")
    try:
        nonce = bytes.fromhex(nonce_hex)
    except (TypeError, ValueError):
        raise unavailable("the nonce is not hex") from None
    if len(nonce) != NONCE_BYTES:
        raise unavailable(f"a nonce of {len(nonce)} bytes")
    fd = open_own_file(os.path.join(directory, name), flags, stat.S_ISREG)
    if fd is None:
        raise unavailable(f"{name}: no {what} file of this user there")
    return fd, nonce


def open_own_file(path: str, flags: int, is_kind) -> int | None:
    """A descriptor of ``path`` if it is a file of ``is_kind`` (stat.S_ISREG, S_ISFIFO) of this
    user, never following a link or blocking on a FIFO; else None."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    if not is_kind(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        return None
    return fd


def younger_than(path: str, seconds: float) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime < seconds
    except OSError:
        return True  # gone already


def remove_stale_files(directory: str, kind_of: Callable[[str], Callable[[int], bool] | None]) -> int:
    """Remove this user's files in ``directory`` whose maker is gone (no process holds their
    lock), each while this holds its lock; returns how many went.
    ``kind_of(name)``: the test of the mode (stat.S_ISREG, S_ISFIFO) a file of that name must
    pass, or None for a name the caller does not make; a file under such a name that fails it
    is left alone. A hidden name (a file being made, unlocked until its maker locks it) is
    passed over until it is MAKING_GRACE_S old."""
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    removed = 0
    for name in names:
        is_kind = kind_of(name)
        if is_kind is None:
            continue
        path = os.path.join(directory, name)
        if name.startswith(".") and younger_than(path, MAKING_GRACE_S):
            continue  # being made: its maker locks it a moment after it appears
        fd = open_own_file(path, os.O_RDONLY, is_kind)
        if fd is None:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its maker lives
        else:
            removed += _unlink_quietly(path)
        finally:
            os.close(fd)
    return removed


def remove_stale_regions(directory: str) -> int:
    """Remove the regions of this user in ``directory`` whose owner is gone (no process holds
    their lock); returns how many. Anything else under a region's name is left alone."""
    return remove_stale_files(directory, _region_file_kind)


def _region_file_kind(name: str) -> Callable[[int], bool] | None:
    return stat.S_ISREG if _REGION_NAME.match(name) or _MAKING_NAME.match(name) else None


def _remove_region(path: str, fd: int, owner_pid: int) -> None:
    """Remove an owned region's file, then let its lock go (a sweep elsewhere finds no
    unlocked file of a live region). Run once: by ``close``, the collector, or at exit."""
    if os.getpid() == owner_pid:
        _unlink_quietly(path)
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: str) -> bool:
    """Whether ``path`` was removed (a failure other than its absence is logged)."""
    try:
        os.unlink(path)
    except OSError as e:
        if not isinstance(e, FileNotFoundError):
            log.warning("cannot remove %s: %s", path, e)
        return False
    return True
