"""The header ring between two processes of one host: records, wrap-around, room, the doorbell,
refusals of what a peer wrote, and its files. No UCX here (``test_ucx_header_ring`` has the
transport over it)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinite_llm.transport import header_ring
from infinite_llm.transport.errors import ProtocolError
from infinite_llm.transport.header_ring import (
    CONTROL_BYTES,
    MIN_DATA_BYTES,
    HeaderRing,
    HeaderRingUnavailable,
    PeerHeaderRing,
    RingBroken,
    remove_stale_rings,
)
from infinite_llm.transport.messages import ErrorCode

pytestmark = pytest.mark.skipif(not header_ring.supported(), reason="header rings need x86-64")

LIMIT = 1 << 20  # the consumer's max_header_bytes


@pytest.fixture
def directory() -> Iterator[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base) as path:
        yield path


@pytest.fixture
def pair(directory) -> Iterator[tuple[HeaderRing, PeerHeaderRing]]:
    producer = HeaderRing(directory, MIN_DATA_BYTES)
    consumer = PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
    yield producer, consumer
    consumer.close()
    producer.close()


def _control(directory: str, name: str) -> np.ndarray:
    """The ring file's first page as u64s, mapped a third time (as a faulty peer would)."""
    return np.memmap(os.path.join(directory, name), dtype="<u8", mode="r+", shape=(CONTROL_BYTES // 8,))


def test_headers_come_out_in_order_and_the_ring_is_then_empty(pair):
    producer, consumer = pair
    assert consumer.take() is None and not consumer.has_frame()
    headers = [bytes([i]) * (i * 37 + 1) for i in range(20)]
    for h in headers:
        assert producer.write(h)
    assert consumer.has_frame()
    assert [consumer.take() for _ in headers] == headers
    assert consumer.take() is None and not consumer.has_frame()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, MIN_DATA_BYTES // 4 - 8), min_size=1, max_size=60), st.integers(1, 5))
def test_records_wrap_around_the_ring_and_room_comes_back_as_they_are_read(sizes, batch):
    """Whatever the sizes, every header written comes out whole and in order; a write finds no
    room only while the consumer holds more than the ring can take beside it."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=base) as directory:
        producer = HeaderRing(directory, MIN_DATA_BYTES)
        consumer = PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
        try:
            written: list[bytes] = []
            taken: list[bytes] = []
            for i, size in enumerate(sizes * 3):
                header = np.random.default_rng(i).integers(0, 256, size, dtype=np.uint8).tobytes()
                while not producer.write(header):
                    assert len(taken) < len(written), "no room in an empty ring"
                    taken.append(consumer.take())
                written.append(header)
                if i % batch == 0:
                    while (h := consumer.take()) is not None:
                        taken.append(h)
            while (h := consumer.take()) is not None:
                taken.append(h)
            assert taken == written
        finally:
            consumer.close()
            producer.close()


def test_a_header_over_a_quarter_of_the_ring_is_not_taken(pair):
    producer, consumer = pair
    assert not producer.write(b"x" * (producer.max_header_bytes + 1))
    assert producer.write(b"x" * producer.max_header_bytes)
    assert consumer.take() == b"x" * producer.max_header_bytes


def test_a_full_ring_takes_nothing_until_the_consumer_reads(pair):
    producer, consumer = pair
    header = b"y" * 1000
    count = 0
    while producer.write(header):
        count += 1
    assert count == MIN_DATA_BYTES // 1008
    assert consumer.take() == header
    assert producer.write(header)


def test_the_bell_rings_for_each_header_and_drains(pair):
    producer, consumer = pair
    assert select.select([consumer.bell_fd], [], [], 0)[0] == []
    producer.write(b"a")
    assert select.select([consumer.bell_fd], [], [], 1)[0] == [consumer.bell_fd]
    consumer.drain_bell()
    assert select.select([consumer.bell_fd], [], [], 0)[0] == []


def test_a_bell_that_overflows_still_wakes(pair):
    """The producer writes a byte per header; a consumer that never sleeps never drains, and
    the FIFO fills: the writes then give up quietly, and the bell still reads as rung."""
    producer, consumer = pair
    for _ in range(70_000):
        producer.write(b"z")
        consumer.take()
    assert select.select([consumer.bell_fd], [], [], 0)[0] == [consumer.bell_fd]


def test_files_are_removed_once_unlinked_and_the_rings_keep_working(pair, directory):
    producer, consumer = pair
    producer.unlink()
    assert os.listdir(directory) == []
    assert producer.write(b"after")
    assert consumer.take() == b"after"


@pytest.mark.parametrize("name", ["", "x.ring", "infllm-1-0123456789abcdef", "../infllm-1-0123456789abcdef.ring",
                                  "infllm-1-0123456789abcdef.bell", "infllm-1-0123456789ABCDEF.ring"])
def test_a_consumer_refuses_names_that_are_not_rings(directory, name):
    with pytest.raises(HeaderRingUnavailable):
        PeerHeaderRing.open(directory, name, "00" * 16, LIMIT)


def test_a_consumer_refuses_a_bad_nonce_a_missing_file_and_a_missing_bell(directory):
    producer = HeaderRing(directory, MIN_DATA_BYTES)
    try:
        with pytest.raises(HeaderRingUnavailable):
            PeerHeaderRing.open(directory, producer.name, "00" * 16, LIMIT)
        with pytest.raises(HeaderRingUnavailable):
            PeerHeaderRing.open(directory, producer.name, "zz", LIMIT)
        with pytest.raises(HeaderRingUnavailable):
            PeerHeaderRing.open(directory, "infllm-1-0123456789abcdef.ring", "00" * 16, LIMIT)
        os.unlink(os.path.join(directory, producer.name.removesuffix(".ring") + ".bell"))
        with pytest.raises(HeaderRingUnavailable, match="doorbell"):
            PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
    finally:
        producer.close()


def test_a_consumer_refuses_a_file_whose_size_disagrees_with_its_data_size(directory):
    producer = HeaderRing(directory, MIN_DATA_BYTES)
    try:
        os.truncate(os.path.join(directory, producer.name), CONTROL_BYTES + MIN_DATA_BYTES // 2)
        with pytest.raises(HeaderRingUnavailable, match="another ring"):
            PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
    finally:
        producer.close()


# --- what a faulty or hostile producer writes --------------------------------------------------


def test_a_write_position_beyond_the_ring_is_refused(pair, directory):
    producer, consumer = pair
    _control(directory, producer.name)[8] = MIN_DATA_BYTES + 8  # more than the ring holds
    with pytest.raises(ProtocolError) as e:
        consumer.take()
    assert e.value.code == ErrorCode.LENGTH_MISMATCH


def test_a_write_position_behind_what_was_read_is_refused(pair, directory):
    producer, consumer = pair
    producer.write(b"abc")
    assert consumer.take() == b"abc"
    _control(directory, producer.name)[8] = 8
    with pytest.raises(ProtocolError):
        consumer.take()


@pytest.mark.parametrize("length, code", [(LIMIT + 1, ErrorCode.OVERSIZED_FRAME),
                                          (4000, ErrorCode.TRUNCATED_FRAME)])
def test_a_record_longer_than_allowed_or_than_written_is_refused(pair, directory, length, code):
    producer, consumer = pair
    producer.write(b"q" * 100)
    data = np.memmap(os.path.join(directory, producer.name), dtype="<u4", mode="r+", offset=CONTROL_BYTES,
                     shape=(4,))
    data[0] = length
    with pytest.raises(ProtocolError) as e:
        consumer.take()
    assert e.value.code == code


def test_a_wrap_marker_with_nothing_after_it_is_refused(pair, directory):
    producer, consumer = pair
    producer.write(b"q" * 100)
    data = np.memmap(os.path.join(directory, producer.name), dtype="<u4", mode="r+", offset=CONTROL_BYTES,
                     shape=(4,))
    data[0] = header_ring.WRAP
    with pytest.raises(ProtocolError):
        consumer.take()


def test_a_producer_takes_an_impossible_read_position_for_a_broken_ring(pair, directory):
    producer, consumer = pair
    producer.write(b"abc")
    control = _control(directory, producer.name)
    control[16] = 1 << 40
    with pytest.raises(RingBroken):
        producer.write(b"def")


# --- files of processes that died ---------------------------------------------------------------


def test_rings_of_killed_processes_are_removed_and_live_ones_kept(pair, directory):
    producer, _consumer = pair
    script = ("import sys, time; from infinite_llm.transport.header_ring import HeaderRing; "
              "r = HeaderRing(sys.argv[1], 1 << 16); print(r.name, flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script, directory], stdout=subprocess.PIPE, text=True)
    try:
        name = child.stdout.readline().strip()
        stem = name.removesuffix(".ring")
        assert name.startswith(f"infllm-{child.pid}-")
        assert remove_stale_rings(directory) == 0  # its maker lives
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert {f"{stem}.ring", f"{stem}.bell"} <= set(os.listdir(directory))
        deadline = time.monotonic() + 5
        removed = 0
        while removed < 2 and time.monotonic() < deadline:
            removed += remove_stale_rings(directory)
            time.sleep(0.05)
        assert removed == 2 and not {f"{stem}.ring", f"{stem}.bell"} & set(os.listdir(directory))
        assert os.path.exists(os.path.join(directory, producer.name))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_a_consumer_reads_on_after_its_producer_was_killed(directory):
    """The mapping outlives the process: what it wrote is still read, and its bell, opened
    read-write here, never reads as an end of file that would wake a wait for ever."""
    script = ("import sys, time; from infinite_llm.transport.header_ring import HeaderRing; "
              "r = HeaderRing(sys.argv[1], 1 << 16); print(r.name, r.nonce.hex(), flush=True); "
              "sys.stdin.readline(); r.write(b'last words'); print('written', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", script, directory], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        name, nonce = child.stdout.readline().split()
        consumer = PeerHeaderRing.open(directory, name, nonce, LIMIT)
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "written"
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert consumer.take() == b"last words"
        consumer.drain_bell()
        assert select.select([consumer.bell_fd], [], [], 0.1)[0] == []
        consumer.close()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
