"""Shared-memory regions: slot bookkeeping, a region and a peer's mapping of it, stale files.

No UCX here (the loopback tests send frames through regions between real processes).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport import shared_memory
from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.shared_memory import (
    HEADER_BYTES,
    SLOT_ALIGNMENT,
    ParallelCopy,
    PeerRegion,
    SharedMemoryUnavailable,
    SharedRegion,
    SlotAllocator,
    remove_stale_regions,
)

MiB = 1 << 20


@pytest.fixture
def region(directory) -> Iterator[SharedRegion]:
    made = SharedRegion(directory, max_bytes=64 * MiB)
    yield made
    made.close()


# --- slots ------------------------------------------------------------------------------------


def test_slots_are_aligned_first_fit_and_reused():
    slots = SlotAllocator(4096, 16 * 4096, alignment=4096)
    a, b, c = slots.allocate(1), slots.allocate(4097), slots.allocate(4096)
    assert (a, b, c) == (4096, 8192, 16384)  # b takes two pages
    slots.free(b)
    assert slots.allocate(4096) == 8192  # the first range that fits: b's
    assert slots.allocate(8192) == 20480  # b's second page alone is too small
    assert slots.allocate(20 * 4096) is None
    with pytest.raises(KeyError):
        slots.free(12345)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5 * 4096), st.integers(0, 1000)), max_size=60))
def test_slots_never_overlap_and_free_ranges_join_again(operations):
    start, capacity, alignment = 4096, 32 * 4096, 4096
    slots = SlotAllocator(start, capacity, alignment)
    held: dict[int, int] = {}  # offset -> bytes asked for
    for allocate, nbytes, pick in operations:
        if allocate or not held:
            offset = slots.allocate(nbytes)
            if offset is not None:
                assert offset % alignment == 0 and start <= offset
                assert offset + max(nbytes, 1) <= start + capacity
                assert offset not in held
                held[offset] = nbytes
        else:
            offset = sorted(held)[pick % len(held)]
            slots.free(offset)
            del held[offset]
        spans = sorted((o, slots.slot_end(o)) for o in held)
        assert all(end <= next_start for (_, end), (next_start, _) in zip(spans, spans[1:]))
        free = slots.free_ranges
        assert all(o + size < next_o for (o, size), (next_o, _) in zip(free, free[1:]))  # joined
        assert slots.bytes_in_use + sum(size for _, size in free) == capacity
    for offset in list(held):
        slots.free(offset)
    assert slots.free_ranges == [(start, capacity)] and slots.num_slots == 0


# --- a region and a peer's mapping ----------------------------------------------------------


def test_a_peer_reads_what_was_copied_in(region, directory):
    data = torch.randn(3 * MiB // 4)
    offset = region.copy_in(data)
    assert offset is not None and offset % SLOT_ALIGNMENT == 0 and offset >= HEADER_BYTES
    peer = PeerRegion.open(directory, region.name, region.nonce.hex())
    landed = torch.empty_like(data)
    assert peer.copy_to(landed.view(torch.uint8).reshape(-1), offset, data.nbytes)
    assert torch.equal(landed, data)
    region.free(offset)
    assert region.bytes_in_use == 0


def test_buffers_of_the_region_are_found_in_it_and_freed_with_their_last_view(region):
    buffer = region.host_buffer(MiB)
    offset = region.offset_of(buffer)
    assert offset is not None and region.bytes_in_use == MiB
    typed = buffer.view(torch.float32)[1024:].view(16, -1)  # a view further in
    assert region.offset_of(typed) == offset + 4096
    assert region.offset_of(torch.empty(MiB, dtype=torch.uint8)) is None
    assert region.offset_of(np.empty(16)) is None
    del buffer
    gc.collect()
    assert region.bytes_in_use == MiB  # the view holds the memory still
    del typed
    gc.collect()
    assert region.bytes_in_use == 0


def test_a_slot_collected_while_its_region_is_locked_is_freed_later_without_a_deadlock(region):
    """The collector runs on whichever thread allocates, also inside ``allocate`` while the
    region's lock is held: the last view of a buffer, dropped there, only queues its slot."""
    buffer = region.host_buffer(MiB)
    cycle: list = [buffer]
    cycle.append(cycle)  # collected only by the cycle collector
    del buffer, cycle
    done = threading.Event()

    def collect_under_the_lock():
        with region._lock:
            gc.collect()
        done.set()
    threading.Thread(target=collect_under_the_lock, daemon=True).start()
    assert done.wait(10), "the collector's free waited for the lock its own thread held"
    assert region.bytes_in_use == 0


def test_a_copy_that_fails_takes_no_slot(region):
    with pytest.raises(ValueError):
        region.copy_in(torch.randn(512, 1024).t())  # not contiguous
    assert region.bytes_in_use == 0


def test_a_full_region_gives_no_slot(region):
    assert region.allocate(region.max_bytes) is None  # the first page is the region's own
    held = region.allocate(60 * MiB)
    assert held is not None and region.allocate(8 * MiB) is None
    region.free(held)
    assert region.allocate(8 * MiB) is not None


def test_a_small_tmpfs_is_committed_as_far_as_it_goes(directory, monkeypatch):
    """A tmpfs with room for 10 MiB (as a container's /dev/shm may have little): the region
    commits what a slot needs where a whole step does not fit, and gives no slot beyond."""
    real_fallocate = os.posix_fallocate

    def fallocate_within_10_mib(fd, offset, length):
        if offset + length > 10 * MiB:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fallocate(fd, offset, length)

    monkeypatch.setattr(shared_memory.os, "posix_fallocate", fallocate_within_10_mib)
    region = SharedRegion(directory, max_bytes=256 * MiB)
    try:
        first = region.allocate(5 * MiB)
        assert first is not None and region.committed_bytes == HEADER_BYTES + 5 * MiB
        assert region.allocate(8 * MiB) is None  # past what the tmpfs holds
        assert region.bytes_in_use == 5 * MiB
        assert region.allocate(4 * MiB) is not None  # still fits
    finally:
        region.close()


@pytest.mark.parametrize("name", ["../passwd", "infllm-1-ZZZZZZZZZZZZZZZZ", "infllm-1-0123456789abcdef/x",
                                  "infllm--0123456789abcdef", "other", ""])
def test_a_peer_refuses_names_that_are_not_regions(directory, name):
    with pytest.raises(SharedMemoryUnavailable):
        PeerRegion.open(directory, name, "00" * 16)


def test_a_peer_refuses_a_missing_file_a_bad_nonce_and_a_foreign_file(region, directory):
    with pytest.raises(SharedMemoryUnavailable, match="no region file"):
        PeerRegion.open(directory, "infllm-1-0123456789abcdef", region.nonce.hex())
    for nonce in ("00" * 16, "zz" * 16, "00" * 8):
        with pytest.raises(SharedMemoryUnavailable):
            PeerRegion.open(directory, region.name, nonce)
    foreign = os.path.join(directory, "infllm-2-0123456789abcdef")
    with open(foreign, "wb") as f:
        f.write(b"\0" * 100)
    with pytest.raises(SharedMemoryUnavailable):
        PeerRegion.open(directory, "infllm-2-0123456789abcdef", "00" * 16)


def test_a_peer_reads_only_what_the_owner_committed(directory):
    region = SharedRegion(directory, max_bytes=256 * MiB)
    peer = PeerRegion.open(directory, region.name, region.nonce.hex())
    page = np.empty(4096, dtype=np.uint8)
    assert not peer.copy_to(page[:16], 0, 16)  # the nonce page
    assert not peer.copy_to(page, HEADER_BYTES, 4096)  # nothing committed past the first page yet
    offset = region.copy_in(np.full(4096, 3, dtype=np.uint8))
    assert peer.copy_to(page, offset, 4096) and (page == 3).all()
    committed = region.committed_bytes
    assert committed < peer.nbytes
    assert peer.copy_to(page, committed - 4096, 4096)
    assert not peer.copy_to(page, committed, 4096)  # a hole: reading it would take a page
    assert not peer.copy_to(np.empty(8, dtype=np.uint8), 1 << 40, 8)
    peer.close()
    assert not peer.copy_to(page, offset, 4096)  # let go: nothing is read any more
    region.close()


def test_files_under_region_names_that_are_not_this_users_regions_are_left_alone(directory):
    fifo = os.path.join(directory, "infllm-7-0000000000000000")
    os.mkfifo(fifo)
    folder = os.path.join(directory, "infllm-8-0000000000000000")
    os.mkdir(folder)
    with pytest.raises(SharedMemoryUnavailable):  # never blocks on the FIFO
        PeerRegion.open(directory, "infllm-7-0000000000000000", "00" * 16)
    assert remove_stale_regions(directory) == 0
    assert os.path.exists(fifo) and os.path.isdir(folder)


def test_a_peer_still_reads_after_the_owner_closed(directory):
    owner = SharedRegion(directory, max_bytes=8 * MiB)
    offset = owner.copy_in(np.full(MiB, 7, dtype=np.uint8))
    peer = PeerRegion.open(directory, owner.name, owner.nonce.hex())
    owner.close()
    assert not os.path.exists(owner.path)
    landed = np.empty(MiB, dtype=np.uint8)
    assert peer.copy_to(landed, offset, MiB) and (landed == 7).all()


def test_a_region_file_left_half_made_is_removed(directory):
    """An owner killed between creating its file and renaming it leaves the file under its
    hidden name, unlocked."""
    path = os.path.join(directory, ".infllm-99999-0123456789abcdef")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    # Young, it may be a live owner's, not locked yet: left alone.
    assert remove_stale_regions(directory) == 0 and os.path.exists(path)
    old = time.time() - shared_memory.MAKING_GRACE_S - 1
    os.utime(path, (old, old))
    assert remove_stale_regions(directory) == 1 and not os.path.exists(path)


def test_regions_of_killed_processes_are_removed_and_live_ones_kept(region, directory):
    script = ("import sys, time; from infinite_llm.transport.shared_memory import SharedRegion; "
              "r = SharedRegion(sys.argv[1], 8 << 20); print(r.name, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script, directory], stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        assert name.startswith(f"infllm-{child.pid}-")
        assert remove_stale_regions(directory) == 0  # its owner lives
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert os.path.exists(os.path.join(directory, name))  # a killed owner leaves its file
        deadline = time.monotonic() + 5
        while remove_stale_regions(directory) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # the lock goes with the process's last file descriptor
        assert not os.path.exists(os.path.join(directory, name))
        assert os.path.exists(region.path)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


# --- frames whose buffers lie in a region -----------------------------------------------------


def test_frames_carry_offsets_for_buffers_placed_in_shared_memory(region, directory):
    runs = (m.BlockRun(0, 2), m.BlockRun(5, 1))
    data = (torch.randn(2, 4096), torch.randn(1, 4096))
    small = torch.arange(4)
    placed: list[int] = []

    def place(array):
        placed.append(region.copy_in(array))
        return placed[-1]

    frame = codec.encode(m.KVBlocks(1, 7, runs, data), 3, place_shared=place, shared_until_ns=time.monotonic_ns() + 10**9)
    assert frame.buffers == () and len(placed) == 2
    header = codec.decode_header(frame.header, codec.FrameLimits())
    assert header.shared_offsets == tuple(placed) and header.num_wire_buffers == 0
    destinations = [torch.empty_like(d) for d in data]
    assert codec.land_inline(header, destinations) == []  # nothing over UCX
    peer = PeerRegion.open(directory, region.name, region.nonce.hex())
    for view, offset, nbytes in codec.shared_destinations(header, destinations):
        assert peer.copy_to(view, offset, nbytes)
    assert all(torch.equal(a, b) for a, b in zip(destinations, data))
    # Inline buffers stay inline; the placement is asked about the others only.
    echo = codec.decode_header(codec.encode(m.Echo(small), 4, place_shared=place).header, codec.FrameLimits())
    assert echo.inline == (True,) and echo.shared_offsets == () and len(placed) == 2


def test_a_placement_that_declines_leaves_the_buffer_on_ucx():
    frame = codec.encode(m.Echo(torch.randn(8192)), 1, place_shared=lambda array: None)
    header = codec.decode_header(frame.header, codec.FrameLimits())
    assert len(frame.buffers) == 1 and header.shared_offsets == () and header.num_wire_buffers == 1


def test_a_frame_with_buffers_in_shared_memory_carries_the_time_they_stop_being_read():
    frame = codec.encode(m.Echo(torch.randn(8192)), 1, place_shared=lambda array: 4096, shared_until_ns=123_456_789)
    header = codec.decode_header(frame.header, codec.FrameLimits())
    assert header.shared_offsets == (4096,) and header.shared_until_ns == 123_456_789 and not frame.buffers
    with pytest.raises(ValueError, match="shared_until_ns"):  # a sender must say it
        codec.encode(m.Echo(torch.randn(8192)), 1, place_shared=lambda array: 4096)
    assert codec.decode_header(codec.encode(m.Echo(torch.randn(8192)), 1).header,
                               codec.FrameLimits()).shared_until_ns == 0  # none in shared memory
    json_len = codec.PREAMBLE.unpack_from(frame.header)[3]
    body = frame.header[codec.PREAMBLE.size:codec.PREAMBLE.size + json_len]
    for su in (b'"su":0', b'"su":-1', b'"su":"1"', b'"su":1.5', b'"su":true', b'"sv":123456789'):
        forged = body.replace(b'"su":123456789', su)
        assert forged != body
        with pytest.raises(ProtocolError) as e:
            codec.decode_header(codec.header_bytes(forged, flags=codec.FLAG_WANTS_REPLY), codec.FrameLimits())
        assert e.value.code == m.ErrorCode.INVALID_FIELDS


@pytest.mark.parametrize("entry", [[32768, 2], [32768, 2, -1], [32768, 3, 0], [32768, 2, "0"],
                                   [32768, 2, 1.5], [32768, 2, 0, 0], [32768, True, 0], [32768, 1, 0]])
def test_malformed_shared_entries_are_refused(entry):
    frame = codec.encode(m.Echo(torch.randn(8192)), 1)
    header = frame.header
    body_start = codec.PREAMBLE.size
    json_len = codec.PREAMBLE.unpack_from(header)[3]
    body = header[body_start:body_start + json_len].replace(b'"b":[[32768,0]]',
                                                             b'"b":[' + json.dumps(entry).replace(" ", "").encode() + b']')
    assert body != header[body_start:body_start + json_len]
    with pytest.raises(ProtocolError):
        codec.decode_header(codec.header_bytes(body, flags=codec.FLAG_WANTS_REPLY), codec.FrameLimits())


@pytest.mark.parametrize("nbytes", [0, 4096, (1 << 20) + 1, 3 * MiB + 12345, 8 * MiB])
def test_a_copy_split_over_threads_copies_every_byte(nbytes):
    copy = ParallelCopy(3)
    source = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    destination = np.zeros(nbytes, dtype=np.uint8)
    copy(destination, source)
    assert np.array_equal(destination, source)


def test_regions_copy_through_their_parallel_copy(directory):
    copy = ParallelCopy(4)
    owner = SharedRegion(directory, max_bytes=32 * MiB, copy=copy)
    try:
        data = torch.randn(5 * MiB // 4)
        offset = owner.copy_in(data)
        peer = PeerRegion.open(directory, owner.name, owner.nonce.hex(), copy)
        landed = torch.empty_like(data)
        assert peer.copy_to(landed.view(torch.uint8).reshape(-1), offset, data.nbytes)
        assert torch.equal(landed, data)
    finally:
        owner.close()
