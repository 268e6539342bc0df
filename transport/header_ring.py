"""Frame headers between the processes of one host, through a ring in shared memory.

A header posted on a UCX endpoint to a local peer goes over TCP loopback (``shared_memory``
says why UCX's own shared memory is off): a system call through the network stack on the
sender, 20-50 us on the development host and 50-77 us inside a daemon on the H200 machine's
host, and a poll of the socket on the receiver. Here the sender copies the header into a ring
in a file of ``/dev/shm`` and rings a doorbell (one byte into a FIFO, which wakes a receiver
asleep in its event loop); a receiver that spins sees the header at its next look. The
frame's buffers, if any, still go over UCX on the frame's own tag, or through the sender's
shared-memory region.

- One ring per connection and direction, made by its producer: the requester's for its
  requests, the listener's for its replies. Both map the file read-write: the consumer
  writes its read position there. The producer never reads back what it wrote, so a consumer
  can spoil nothing but its own frames.
- The first page holds the nonce (which proves the file is the offerer's), the data size, and
  two positions, each a u64 byte count since the ring began, on a cache line of its own: the
  producer's write position and the consumer's read position. A record is a u32 length, a u32
  stamp and the header, padded to 8 bytes; where a record would run past the ring's end, a
  wrap marker (length ``WRAP``) sends the reader back to the start.
- Headers that do not fit (too large, or the ring full) go over UCX. A record's stamp counts
  the headers its producer sent over UCX on the connection before it, and the consumer takes
  a record only once it has received that many: a connection's headers are handled in the
  order they were sent, whichever way each went.
- Memory order: the producer stores a record, then its write position; the consumer loads the
  write position, then the record, and stores its read position once it copied the record
  out. x86-64 keeps stores in order with stores and loads with loads, which is all this needs;
  elsewhere no ring is offered (``supported``) and headers stay on UCX.
- What the peer writes is checked, never trusted: a consumer refuses a position or a length
  that does not fit (``ProtocolError``: the frame is refused and the connection closed), and a
  producer takes a read position outside [its last one, its write position] for a broken
  connection (``RingBroken``).
- A killed peer is noticed by UCX on the connection's endpoint, where a header receive is
  always posted; the ring is only data. The doorbell is opened read-write by the consumer too,
  so that a producer that died leaves no end-of-file to wake on forever.
- Files: made locked (flock) under a name the stale sweep knows, and removed as soon as the
  peer has opened them (mappings and descriptors outlive the names). A process killed before
  that leaves them to ``remove_stale_rings``.

No UCX here.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import platform
import re
import secrets
import stat
import struct
from collections.abc import Callable

from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.messages import ErrorCode
# A ring's file is offered, checked and swept as a region's is, with a nonce of the same length.
from infinite_llm.transport.shared_memory import NONCE_BYTES, open_offered_file, open_own_file, remove_stale_files

CONTROL_BYTES = 4096  # the first page: nonce, data size, positions; the data follows
_DATA_SIZE_AT = 16  # u64
_WRITE_AT = 64  # u64, the producer's; a cache line of its own
_READ_AT = 128  # u64, the consumer's
RECORD_ALIGNMENT = 8
_PREFIX = struct.Struct("<II")  # a record's length and stamp
RECORD_PREFIX_BYTES = _PREFIX.size
WRAP = 0xFFFFFFFF  # a record length that sends the reader back to the ring's start
STAMP_MASK = 0xFFFFFFFF  # a record's stamp: the producer's headers sent over UCX before it, mod 2**32
STAMP_HALF = 1 << 31
_WRAP_MARK = struct.Struct("<I")
_POSITION = struct.Struct("<Q")
MIN_DATA_BYTES = 64 << 10
_RING_NAME = re.compile(r"infllm-(\d{1,10})-([0-9a-f]{16})\.ring\Z")
_STALE_NAME = re.compile(r"\.?infllm-(\d{1,10})-([0-9a-f]{16})\.(ring|bell)\Z")


def supported() -> bool:
    """Whether this machine's memory order lets the ring go without fences (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class HeaderRingUnavailable(Exception):
    """A peer's ring cannot be used (another host, another user, a stale or foreign file)."""


class RingBroken(Exception):
    """The consumer's read position is impossible: the ring can no longer be trusted."""


def _record_bytes(header_bytes: int) -> int:
    return -(-(RECORD_PREFIX_BYTES + header_bytes) // RECORD_ALIGNMENT) * RECORD_ALIGNMENT


class HeaderRing:
    """The producer's side: a ring of ``data_bytes`` in a new file of ``directory``.

    Headers over ``max_header_bytes`` (a quarter of the ring, so that several fit) are not
    taken; nor is one the ring has no room for while the consumer is behind. The caller sends
    those over UCX, and the records' stamps keep the connection's headers in the order they
    were sent (``PeerHeaderRing.take``). Used from its transport's event loop only.
    """

    def __init__(self, directory: str = "/dev/shm", data_bytes: int = 2 << 20) -> None:
        data_bytes -= data_bytes % RECORD_ALIGNMENT
        if data_bytes < MIN_DATA_BYTES:
            raise ValueError(f"a header ring needs at least {MIN_DATA_BYTES} bytes, got {data_bytes}")
        remove_stale_rings(directory)
        stem = f"infllm-{os.getpid()}-{secrets.token_hex(8)}"
        self.name = f"{stem}.ring"
        self.data_bytes = data_bytes
        self.max_header_bytes = data_bytes // 4 - RECORD_PREFIX_BYTES
        self.nonce = secrets.token_bytes(NONCE_BYTES)
        self._paths: list[str] = []
        self._map: mmap.mmap | None = None
        self._bell_fd = -1
        self._ring_fd = -1
        try:
            self._map = self._make_ring(directory, stem)
            self._make_bell(directory, stem)
        except BaseException:
            self.close()
            raise
        self._write_view, self._read_view = _position_views(self._map)
        self._write_pos = 0
        self._last_read = 0
        self.closed = False

    def _make_ring(self, directory: str, stem: str) -> mmap.mmap:
        # Made under a hidden name, which a sweep passes over while it is young (it is
        # unlocked until the lock below), then renamed once locked.
        making = os.path.join(directory, f".{stem}.ring")
        fd = self._ring_fd = os.open(making, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        self._paths.append(making)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while this process lives
        size = CONTROL_BYTES + self.data_bytes
        os.ftruncate(fd, size)
        # All of it committed now: a full tmpfs shows here as an error, never later as a SIGBUS.
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, self.nonce + self.data_bytes.to_bytes(8, "little"), 0)
        mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        path = os.path.join(directory, self.name)
        os.rename(making, path)
        self._paths[-1] = path
        return mapped

    def _make_bell(self, directory: str, stem: str) -> None:
        making = os.path.join(directory, f".{stem}.bell")
        os.mkfifo(making, 0o600)
        self._paths.append(making)
        # Read-write: opening a FIFO for writing alone fails while no one reads it.
        fd = self._bell_fd = os.open(making, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path = os.path.join(directory, f"{stem}.bell")
        os.rename(making, path)
        self._paths[-1] = path

    def write(self, header: bytes, ucx_headers_sent: int = 0) -> bool:
        """Put one header in the ring and ring the bell; False where it is over
        ``max_header_bytes`` or the ring has no room for it now. Raises RingBroken where the
        consumer's read position is impossible. ``ucx_headers_sent``: the headers this side
        has sent over UCX on the connection so far (the record's stamp: the consumer takes
        those first)."""
        nbytes = len(header)
        if nbytes > self.max_header_bytes or self.closed:
            return False
        read = self._read_view[0]
        position = self._write_pos
        if read < self._last_read or read > position:
            raise RingBroken(f"read position {read} outside [{self._last_read}, {position}]")
        self._last_read = read
        size = self.data_bytes
        offset = position % size
        record = _record_bytes(nbytes)
        skip = size - offset if size - offset < record else 0
        if position + skip + record - read > size:
            return False
        ring = self._map
        if skip:
            _WRAP_MARK.pack_into(ring, CONTROL_BYTES + offset, WRAP)
            offset = 0
        start = CONTROL_BYTES + offset
        _PREFIX.pack_into(ring, start, nbytes, ucx_headers_sent & STAMP_MASK)
        start += RECORD_PREFIX_BYTES
        ring[start:start + nbytes] = header
        self._write_pos = position + skip + record
        self._write_view[0] = self._write_pos  # after the record: the consumer reads up to it
        try:
            os.write(self._bell_fd, b"\x01")
        except BlockingIOError:
            pass  # the FIFO is full: the consumer has a wake-up waiting already
        return True

    def unlink(self) -> None:
        """Remove the files' names (the peer has opened them, or never will)."""
        for path in self._paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._paths = []

    def close(self) -> None:
        self.closed = True
        self.unlink()
        for fd in (self._bell_fd, self._ring_fd):
            if fd >= 0:
                os.close(fd)
        self._bell_fd = self._ring_fd = -1
        if self._map is not None:
            _unmap(self._map, (self._write_view, self._read_view))
            self._map = None


class PeerHeaderRing:
    """The consumer's side: a peer's ring, mapped read-write (to publish the read position),
    and its doorbell."""

    def __init__(self, name: str, mapped: mmap.mmap, bell_fd: int, data_bytes: int,
                 max_header_bytes: int) -> None:
        self.name = name
        self.data_bytes = data_bytes
        self.max_header_bytes = max_header_bytes
        self.bell_fd = bell_fd
        self._map = mapped
        self._write_view, self._read_view = _position_views(mapped)
        self._read_pos = self._read_view[0]
        self.waits_for_ucx = False
        self._watcher: tuple[object, object] | None = None  # (event loop, future) while watched
        self.closed = False

    @classmethod
    def open(cls, directory: str, name: str, nonce_hex: str, max_header_bytes: int) -> PeerHeaderRing:
        """Open the ring ``name`` of ``directory`` and its bell, if they are this user's and
        the ring's first bytes are the nonce. Raises HeaderRingUnavailable otherwise.
        ``max_header_bytes``: this receiver's limit (a longer record is refused)."""
        fd, nonce = open_offered_file(directory, name, nonce_hex, os.O_RDWR, name_form=_RING_NAME,
                                      what="ring", unavailable=HeaderRingUnavailable)
        try:
            size = os.fstat(fd).st_size
            first = os.pread(fd, NONCE_BYTES + 8, 0)
            data_bytes = int.from_bytes(first[NONCE_BYTES:], "little")
            if (first[:NONCE_BYTES] != nonce or data_bytes < MIN_DATA_BYTES
                    or data_bytes % RECORD_ALIGNMENT or size != CONTROL_BYTES + data_bytes):
                raise HeaderRingUnavailable(f"{name}: another ring under that name")
            mapped = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as e:  # ValueError: the file was cut short meanwhile
            raise HeaderRingUnavailable(f"cannot map {name}: {e}") from None
        finally:
            os.close(fd)
        # Reading starts where the producer left the read position: records start on their
        # alignment, and a prefix read from anywhere else could run past the ring's end.
        read = _POSITION.unpack_from(mapped, _READ_AT)[0]
        if read % RECORD_ALIGNMENT:
            mapped.close()
            raise HeaderRingUnavailable(f"{name}: its read position {read} is not on a record's start")
        # Read-write, as the producer has it: a FIFO whose last writer is gone reads as
        # end-of-file, readable for ever.
        bell_fd = open_own_file(os.path.join(directory, name.removesuffix(".ring") + ".bell"),
                            os.O_RDWR, stat.S_ISFIFO)
        if bell_fd is None:
            mapped.close()
            raise HeaderRingUnavailable(f"{name}: no doorbell of this user beside it")
        return cls(name, mapped, bell_fd, data_bytes, max_header_bytes)

    def has_frame(self) -> bool:
        return not self.closed and self._write_view[0] != self._read_pos

    def take(self, ucx_headers_taken: int | None = None) -> bytes | None:
        """The next header's bytes (a copy), or None where the ring is empty. Raises
        ProtocolError where the producer's position or a record does not fit.

        ``ucx_headers_taken``: how many of the producer's headers this side has received over
        UCX. A record the producer wrote after sending more than that many over UCX is left
        where it is (None, and ``waits_for_ucx`` is True): those headers go first, so that a
        connection's headers are handled in the order they were sent, whichever way each
        went. None: take it whatever its stamp (the connection is failing)."""
        self.waits_for_ucx = False
        if self.closed:
            return None
        written = self._write_view[0]
        read = self._read_pos
        if written == read:
            return None
        size = self.data_bytes
        if written < read or written - read > size:
            raise ProtocolError(ErrorCode.LENGTH_MISMATCH, f"ring write position {written}, read {read}")
        offset = read % size
        ring = self._map
        nbytes, stamp = _PREFIX.unpack_from(ring, CONTROL_BYTES + offset)
        if nbytes == WRAP:
            read += size - offset
            offset = 0
            if written == read:
                raise ProtocolError(ErrorCode.TRUNCATED_FRAME, "a ring's wrap marker with no record after it")
            nbytes, stamp = _PREFIX.unpack_from(ring, CONTROL_BYTES)
        record = _record_bytes(nbytes)
        if nbytes > self.max_header_bytes:
            raise ProtocolError(ErrorCode.OVERSIZED_FRAME, f"a ring record of {nbytes} bytes")
        if offset + record > size or read + record > written:
            raise ProtocolError(ErrorCode.TRUNCATED_FRAME, f"a ring record of {nbytes} bytes past its end")
        if ucx_headers_taken is not None:
            # Stamps count modulo 2**32; one ahead of the count by less than half that waits.
            ahead = (stamp - ucx_headers_taken) & STAMP_MASK
            if 0 < ahead < STAMP_HALF:
                self.waits_for_ucx = True
                return None
        start = CONTROL_BYTES + offset + RECORD_PREFIX_BYTES
        header = ring[start:start + nbytes]
        self._read_pos = read + record
        self._read_view[0] = self._read_pos  # after the copy: the producer may write over it now
        return header

    def drain_bell(self) -> None:
        """Empty the doorbell, before a wait that it should wake."""
        try:
            while os.read(self.bell_fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def watch(self, loop, future) -> None:
        """Wake ``future`` (set its result) when the bell rings, or when the ring is closed."""
        self.unwatch()
        loop.add_reader(self.bell_fd, _wake, future)
        self._watcher = (loop, future)

    def unwatch(self) -> None:
        if self._watcher is not None:
            loop, _future = self._watcher
            self._watcher = None
            loop.remove_reader(self.bell_fd)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        watcher = self._watcher
        self.unwatch()  # before the descriptor goes: its number may be another's next
        if watcher is not None:
            _wake(watcher[1])
        os.close(self.bell_fd)
        _unmap(self._map, (self._write_view, self._read_view))


def _position_views(mapped: mmap.mmap) -> tuple[memoryview, memoryview]:
    """The write and read positions of a mapped ring, each a one-element u64 view (native
    order: little-endian on x86-64, where rings are offered): an index loads or stores the
    whole aligned word at once, as the memory order above needs."""
    control = memoryview(mapped)
    return (control[_WRITE_AT:_WRITE_AT + 8].cast("Q"), control[_READ_AT:_READ_AT + 8].cast("Q"))


def _unmap(mapped: mmap.mmap, views: tuple[memoryview, ...]) -> None:
    for view in views:
        view.release()
    try:
        mapped.close()
    except BufferError:
        pass  # another view of it lives on (a caller's); unmapped with it


def _wake(future) -> None:
    if not future.done():
        future.set_result(None)


def remove_stale_rings(directory: str) -> int:
    """Remove this user's ring and doorbell files in ``directory`` whose maker is gone (no
    process holds their lock); returns how many."""
    return remove_stale_files(directory, _ring_file_kind)


def _ring_file_kind(name: str) -> Callable[[int], bool] | None:
    match = _STALE_NAME.match(name)
    if match is None:
        return None
    return stat.S_ISFIFO if match.group(3) == "bell" else stat.S_ISREG
