"""The header ring between two processes of one host: records, wrap-around, room, the doorbell,
refusals of what a peer wrote, and its files. No UCX here (``test_ucx_header_ring`` has the
transport over it)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from infinite_llm.transport import header_ring, shared_memory
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

from conftest import shm_temporary_directory

pytestmark = pytest.mark.skipif(not header_ring.supported(), reason="header rings need x86-64")

LIMIT = 1 << 20  # the consumer's max_header_bytes


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
    with shm_temporary_directory() as directory:
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


def test_a_record_waits_for_the_headers_its_producer_sent_over_ucx_before_it(pair):
    """Each record carries how many headers its producer had sent over UCX; the consumer
    leaves it until it has received as many that way (counted modulo 2**32), unless told to
    take whatever is there."""
    producer, consumer = pair
    assert producer.write(b"after three", ucx_headers_sent=3)
    assert consumer.take(2) is None and consumer.waits_for_ucx
    assert consumer.has_frame()
    assert consumer.take(3) == b"after three" and not consumer.waits_for_ucx
    assert producer.write(b"behind", ucx_headers_sent=5)
    assert consumer.take(10) == b"behind"  # an older stamp: those headers came long ago
    assert producer.write(b"wrapped", ucx_headers_sent=(1 << 32) + 1)
    assert consumer.take(1 << 32) is None and consumer.waits_for_ucx
    assert consumer.take((1 << 32) + 1) == b"wrapped"
    assert producer.write(b"failing", ucx_headers_sent=100)
    assert consumer.take(None) == b"failing"  # the connection fails: whatever is there


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


@pytest.mark.parametrize("read", [MIN_DATA_BYTES - 4, 3, 12])
def test_a_consumer_refuses_a_ring_whose_read_position_is_off_a_records_start(directory, read):
    """Reading starts at the read position the producer left in the file: one off the records'
    alignment would read a record's prefix across the ring's end (struct.error, not a refusal)."""
    producer = HeaderRing(directory, MIN_DATA_BYTES)
    control = _control(directory, producer.name)
    try:
        control[16] = read
        control[8] = read + 8
        with pytest.raises(HeaderRingUnavailable, match="not on a record's start"):
            PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
        control[16] = control[8] = MIN_DATA_BYTES - 8  # on a record's start: opened
        PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT).close()
    finally:
        del control
        producer.close()


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


def test_ring_files_left_half_made_are_removed_once_old(directory):
    """A maker killed between creating its files and renaming them leaves them under their
    hidden names, unlocked; a live maker's look the same for a moment, so only old ones go."""
    ring = os.path.join(directory, ".infllm-99999-0123456789abcdef.ring")
    bell = os.path.join(directory, ".infllm-99999-0123456789abcdef.bell")
    with open(ring, "wb") as f:
        f.write(b"\0" * 8192)
    os.mkfifo(bell, 0o600)
    assert remove_stale_rings(directory) == 0 and os.path.exists(ring) and os.path.exists(bell)
    old = time.time() - shared_memory.MAKING_GRACE_S - 1
    for path in (ring, bell):
        os.utime(path, (old, old))
    assert remove_stale_rings(directory) == 2 and os.listdir(directory) == []


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


# --- fuzz: whatever a producer leaves in the ring, the consumer takes bytes or refuses --------

RING_FUZZ_EXAMPLES = 2_500
RING_FUZZ_EXAMPLES_SLOW = 25_000


@st.composite
def ring_states(draw) -> tuple[int, int, bytes, list[tuple[int, int]], int | None]:
    """A write and a read position (near each other, around a wrap, or anywhere), data
    bytes, u32 words planted at record offsets (lengths: valid ones, wrap markers, garbage;
    or stamps), and the count of UCX headers the consumer has taken (None: any record)."""
    size = MIN_DATA_BYTES
    read = draw(st.sampled_from([0, 8, size - 8, size - 64, size * 3 - 16]) | st.integers(0, 1 << 40).map(lambda x: x * 8))
    written = draw(st.one_of(
        st.just(read), st.integers(0, 4096).map(lambda d: read + d * 8), st.integers(0, 1 << 41),
        st.integers(-64, 64).map(lambda d: max(0, read + d * 8))))
    data = draw(st.binary(max_size=256))
    lengths = draw(st.lists(st.tuples(st.integers(0, size // 4 - 1).map(lambda x: x * 4),
                                      st.sampled_from([0, 1, 7, 100, 4000, header_ring.WRAP, LIMIT + 1, 1 << 31])
                                      | st.integers(0, (1 << 32) - 1)), max_size=4))
    count = draw(st.none() | st.integers(0, (1 << 33)))  # UCX headers taken so far
    return written, read, data, lengths, count


def _take_all_or_refuse(consumer: PeerHeaderRing, count: int | None) -> None:
    for _ in range(64):
        try:
            header = consumer.take(count)
        except ProtocolError:
            return
        if header is None:
            return
        assert isinstance(header, bytes) and len(header) <= LIMIT


def _fuzz_ring(examples: int) -> None:
    with shm_temporary_directory() as directory:
        producer = HeaderRing(directory, MIN_DATA_BYTES)
        path = os.path.join(directory, producer.name)
        control = np.memmap(path, dtype="<u8", mode="r+", shape=(CONTROL_BYTES // 8,))
        data = np.memmap(path, dtype=np.uint8, mode="r+", offset=CONTROL_BYTES, shape=(MIN_DATA_BYTES,))
        try:
            @settings(max_examples=examples, deadline=None, database=None)
            @given(ring_states())
            def consumer_takes_or_refuses(state) -> None:
                written, read, payload, lengths, count = state
                data[:len(payload)] = np.frombuffer(payload, dtype=np.uint8)
                for offset, length in lengths:
                    data[offset:offset + 4] = np.frombuffer(length.to_bytes(4, "little"), dtype=np.uint8)
                control[16] = read  # where a consumer that opens the ring starts
                control[8] = written
                consumer = PeerHeaderRing.open(directory, producer.name, producer.nonce.hex(), LIMIT)
                try:
                    _take_all_or_refuse(consumer, count)
                finally:
                    consumer.close()

            consumer_takes_or_refuses()
        finally:
            producer.close()


def test_fuzz_ring_contents():
    _fuzz_ring(RING_FUZZ_EXAMPLES)


@pytest.mark.slow
def test_fuzz_ring_contents_long():
    _fuzz_ring(RING_FUZZ_EXAMPLES_SLOW)
