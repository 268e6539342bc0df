"""A KV move travels as one buffer per run of consecutive destination blocks."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from infinite_llm.transport.block_runs import destination_runs
from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.kv_packing import (
    HostStaging,
    KVPacker,
    gather_graph_sizes,
    pack_kv_runs,
    wait_for_event,
)
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.shared_memory import SharedRegion


def test_runs_follow_the_destinations_whatever_the_sources():
    runs = destination_runs([7, 2, 9, 10, 4], [20, 21, 22, 30, 31])
    assert [(r.dst_block_id, r.src_block_ids) for r in runs] == [(20, (7, 2, 9)), (30, (10, 4))]
    assert [r.src_consecutive for r in runs] == [False, False]
    assert destination_runs([3, 4, 5], [0, 1, 2])[0].src_consecutive


def test_run_length_is_capped():
    runs = destination_runs(list(range(5)), list(range(5)), max_run_blocks=2)
    assert [r.num_blocks for r in runs] == [2, 2, 1]


@given(st.lists(st.integers(0, 63), min_size=1, max_size=24, unique=True),
       st.lists(st.integers(0, 63), min_size=1, max_size=24, unique=True))
def test_packed_buffers_land_every_block_where_it_belongs(sources, destinations):
    n = min(len(sources), len(destinations))
    sources, destinations = sources[:n], destinations[:n]
    pool = torch.randn(64, 3, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    runs, buffers = pack_kv_runs(pool, sources, destinations)
    received = torch.full_like(pool, float("nan"))
    for run, buffer in zip(runs, buffers, strict=True):
        assert buffer.is_contiguous() and buffer.shape == (run.num_blocks, *pool.shape[1:])
        received[run.dst_block_id:run.dst_block_id + run.num_blocks] = buffer
    for src, dst in zip(sources, destinations):
        assert torch.equal(received[dst], pool[src])
    assert len(runs) == len(destination_runs(sources, destinations))


def test_consecutive_sources_are_views_not_copies():
    pool = torch.randn(16, 2, 2, 4, 1, 8)
    _, buffers = pack_kv_runs(pool, [4, 5, 6], [0, 1, 2])
    assert buffers[0].data_ptr() == pool[4].data_ptr()


def test_a_staged_gather_matches_the_unstaged_one():
    pool = torch.randn(32, 2, 2, 4, 1, 8)
    staging = HostStaging()
    sources, destinations = [9, 3, 17, 4, 5], [0, 1, 2, 10, 11]
    assert all(torch.equal(a, b) for a, b in zip(pack_kv_runs(pool, sources, destinations, staging)[1],
                                                pack_kv_runs(pool, sources, destinations)[1], strict=True))


def test_staging_hands_a_buffer_out_again_only_once_given_back():
    pool = torch.randn(32, 2, 2, 4, 1, 8)
    staging = HostStaging()
    _, first = pack_kv_runs(pool, [9, 3], [0, 1], staging)
    _, second = pack_kv_runs(pool, [9, 3], [0, 1], staging)
    assert first[0].data_ptr() != second[0].data_ptr()  # the first is still lent
    staging.give_back(first)
    _, third = pack_kv_runs(pool, [1, 30], [4, 5], staging)  # same size: the buffer of the first
    assert third[0].data_ptr() == first[0].data_ptr()
    assert torch.equal(third[0], pool[[1, 30]])
    smaller = staging.take((1, 2, 2, 4, 1, 8), pool.dtype)  # a free buffer larger than asked will do
    staging.give_back(third)
    staging.give_back([smaller])
    assert staging.num_free == 2


def test_views_of_the_pool_are_not_taken_into_staging():
    pool = torch.randn(16, 2, 2, 4, 1, 8)
    staging = HostStaging()
    _, buffers = pack_kv_runs(pool, [4, 5, 6], [0, 1, 2], staging)
    staging.give_back(buffers)
    assert staging.num_free == 0


def test_staging_keeps_only_its_largest_free_buffers():
    staging = HostStaging(max_free=2)
    taken = [staging.take((n,), torch.float32) for n in (10, 40, 20)]
    staging.give_back(taken)
    assert staging.num_free == 2
    assert staging.take((40,), torch.float32).numel() == 40  # the 40 was kept
    assert staging.take((20,), torch.float32).numel() == 20  # and the 20, not the 10


def test_staging_takes_new_buffers_from_its_allocator_while_it_has_room(tmp_path):
    """A mover's staging comes from the transport's shared memory, so a gather goes to a local
    peer with no copy; where that is full, from ordinary memory."""
    region = SharedRegion(str(tmp_path), max_bytes=1 << 20)
    try:
        staging = HostStaging(allocate=region.host_buffer)
        pool = torch.randn(64, 2, 2, 4, 1, 8)  # 512 bytes a block
        _, gathered = pack_kv_runs(pool, [9, 3, 40], [0, 1, 2], staging)
        assert region.offset_of(gathered[0]) is not None
        assert torch.equal(gathered[0], pool[[9, 3, 40]])
        too_big = staging.take((4096, 512), torch.uint8)  # 2 MiB: more than the region holds
        assert region.offset_of(too_big) is None
        staging.give_back(gathered)
        assert staging.take((3, 2, 2, 4, 1, 8), pool.dtype).data_ptr() == gathered[0].data_ptr()
    finally:
        region.close()


def test_a_packer_gathers_a_host_pool_into_its_staging_with_nothing_to_wait_for():
    pool = torch.randn(32, 2, 2, 4, 1, 8)
    packer = KVPacker()
    runs, buffers, ready = packer.pack(pool, [7, 2, 30, 31], [0, 1, 2, 3])
    assert ready is None
    assert [(r.dst_block_id, r.num_blocks) for r in runs] == [(0, 4)]
    assert torch.equal(buffers[0], pool[[7, 2, 30, 31]])
    packer.give_back(buffers)
    assert packer.staging.num_free == 1
    asyncio.run(wait_for_event(ready, time.monotonic()))  # None: at once, even past the deadline


@pytest.mark.gpu
def test_a_device_gather_is_ready_after_its_event_behind_the_kernels_that_wrote_the_pool():
    pool = torch.zeros(64, 4096, device="cuda")
    offsets = torch.arange(64, device="cuda", dtype=pool.dtype)[:, None]
    packer = KVPacker()
    packer.prepare(pool)  # the packer's own first uses, which wait for the device, done now
    pool.add_(offsets)  # and this test's: a kernel's first launch waits for the device too
    pool.sub_(offsets)
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the current stream busy for a while, then the pool written
    pool.add_(offsets)
    runs, buffers, ready = packer.pack(pool, [5, 40, 9], [0, 1, 2])
    # Queued behind the pool's writer, and the host did not wait for it (the block ids went
    # up without a stream wait).
    assert ready is not None and not ready.query()

    async def wait() -> None:
        await wait_for_event(ready, time.monotonic() + 30)

    asyncio.run(wait())
    assert buffers[0][:, 0].tolist() == [5.0, 40.0, 9.0]
    with pytest.raises(TimeoutError):
        torch.cuda._sleep(50_000_000)  # the packer's stream exists: nothing here waits for it
        _, _, late = packer.pack(pool, [1, 3], [0, 1])
        asyncio.run(wait_for_event(late, time.monotonic()))  # the deadline passed already
    torch.cuda.synchronize()


def test_gathers_are_captured_for_powers_of_two_that_fit_the_bytes_and_the_pool():
    assert gather_graph_sizes(1000, 64 << 10, max_bytes=8 << 20) == (2, 4, 8, 16, 32, 64, 128)
    assert gather_graph_sizes(40, 64 << 10, max_bytes=8 << 20) == (2, 4, 8, 16, 32)
    assert gather_graph_sizes(1000, 2 << 20, max_bytes=8 << 20) == (2, 4)  # Llama-3-8B's blocks
    assert gather_graph_sizes(1000, 16 << 20, max_bytes=8 << 20) == ()
    assert gather_graph_sizes(1, 1024) == ()


@pytest.mark.gpu
def test_captured_gathers_match_a_gather_of_every_size_and_are_used_again_once_given_back():
    pool = torch.randn(64, 3, 2, 4, 2, 8, device="cuda")
    packer = KVPacker(graphs_per_size=1)
    packer.prepare(pool)
    graphs = packer.graphs_of(pool)
    assert graphs.sizes == gather_graph_sizes(64, pool[0].nbytes) and graphs.num_free == len(graphs.sizes)
    generator = torch.Generator().manual_seed(3)
    for n in (2, 3, 5, 8, 17, 33, 64, 3):  # the last after larger ones: their ids stay in the buffer
        sources = torch.randperm(64, generator=generator)[:n].tolist()
        runs, buffers, ready = packer.pack(pool, sources, list(range(n)))
        ready.synchronize()
        assert [(r.dst_block_id, r.num_blocks) for r in runs] == [(0, n)]
        assert torch.equal(buffers[0], pool[sources]) and buffers[0].shape == (n, *pool.shape[1:])
        assert graphs.num_free == len(graphs.sizes) - 1  # lent out until given back
        packer.give_back(buffers)
        packer.give_back(buffers)  # once only
        assert graphs.num_free == len(graphs.sizes)


@pytest.mark.gpu
def test_gathers_beyond_the_free_graphs_are_launched_as_before():
    pool = torch.randn(16, 2, 64, device="cuda")
    packer = KVPacker(graphs_per_size=1)
    packer.prepare(pool)
    graphs = packer.graphs_of(pool)
    assert graphs.sizes == (2, 4, 8, 16)
    lent = []
    for _ in range(5):  # sizes 4, 8, 16 (the next free one that holds three), then none
        _, buffers, ready = packer.pack(pool, [9, 2, 14], [0, 1, 2])
        ready.synchronize()
        assert torch.equal(buffers[0], pool[[9, 2, 14]])
        lent.append(buffers)
    assert [hasattr(b[0], "_gather_graph") for b in lent] == [True, True, True, False, False]
    assert graphs.num_free == 1  # the one of two blocks
    for buffers in lent:
        packer.give_back(buffers)
    assert graphs.num_free == 4


@pytest.mark.gpu
def test_device_ready_leaves_the_stream_wait_out_of_the_encode(monkeypatch):
    waits = []
    monkeypatch.setattr(codec, "wait_for_producers", waits.append)
    blocks = torch.zeros(2, 65536, dtype=torch.uint8, device="cuda")  # over the inline limit
    message = m.KVBlocks(1, 1, (m.BlockRun(0, 2),), (blocks,))
    codec.encode(message, 1, device_ready=True)
    assert waits == []
    codec.encode(message, 2)
    assert len(waits) == 1 and waits[0][0] is blocks


class _FlagEvent:
    """Stands for a CUDA event: done once ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_waiting_for_an_event_lets_the_loop_turn():
    async def scenario() -> None:
        event = _FlagEvent()
        asyncio.get_running_loop().call_soon(setattr, event, "done", True)  # runs only if the wait yields
        await wait_for_event(event, time.monotonic() + 5)

    asyncio.run(scenario())


def test_waiting_for_an_event_ends_at_its_deadline():
    with pytest.raises(TimeoutError):
        asyncio.run(wait_for_event(_FlagEvent(), time.monotonic() + 0.02))


HOME, CREDITOR = PeerAddress("memory", 1), PeerAddress("memory", 2)


def send_scattered_blocks(packer: KVPacker, device: str, timeout_s: float = 5.0, refuse: bool = False,
                          before=None):
    """``packer.send`` of three scattered blocks of a pool into blocks 3-5 of a peer's, over the
    in-memory network; returns the source pool, the peer's pool, the reply (or the exception)
    and the network's message types. ``refuse``: the peer's handler fails on the landed blocks.
    ``before(pool)`` runs first."""
    async def scenario():
        network = InMemoryNetwork()
        home, creditor = network.transport(HOME), network.transport(CREDITOR)
        received = torch.zeros(8, 4, 16, device=device)

        def handle(message):
            if refuse:
                raise ValueError("the reservation is gone")
            return m.KVBlocksStored(message.move_id, message.reservation_id, sum(r.num_blocks for r in message.runs))

        def place(message):
            return [received[r.dst_block_id:r.dst_block_id + r.num_blocks] for r in message.runs]

        await home.start(lambda message: None)
        await creditor.start(handle, place)
        pool = torch.randn(16, 4, 16, device=device)
        if before is not None:
            before(pool)
        try:
            reply = await packer.send(home, CREDITOR, pool, [9, 2, 14], [3, 4, 5],
                                      lambda runs, data: m.KVBlocks(7, 70, runs, data), timeout_s)
        except (TimeoutError, RemoteError) as exc:
            reply = exc
        await network.settle()
        return pool, received, reply, [t for _, _, t in network.messages()]
    return asyncio.run(scenario())


def test_a_packed_move_lands_in_the_peers_blocks_and_its_staging_comes_back():
    packer = KVPacker()
    pool, received, reply, types = send_scattered_blocks(packer, "cpu")
    assert reply == m.KVBlocksStored(7, 70, 3)
    assert torch.equal(received[3:6], pool[[9, 2, 14]])
    assert types == ["kv_blocks", "kv_blocks_stored"]
    assert packer.staging.num_free == 1  # answered: the gather's buffer is used again


def test_a_packed_move_the_peer_answered_with_an_error_gives_its_staging_back():
    """The peer's handler ran on the landed blocks and failed: it reads them no more."""
    packer = KVPacker()
    _, _, reply, types = send_scattered_blocks(packer, "cpu", refuse=True)
    assert isinstance(reply, RemoteError) and reply.code == m.ErrorCode.HANDLER_FAILED
    assert types == ["kv_blocks", "error_reply"] and packer.staging.num_free == 1


class _NeverReadyPacker(KVPacker):
    """A packer whose gathers never finish on the device."""

    def pack(self, pool, src_block_ids, dst_block_ids):
        runs, buffers, _ = super().pack(pool, src_block_ids, dst_block_ids)
        return runs, buffers, _FlagEvent()


def test_a_packed_move_whose_gather_does_not_finish_in_time_sends_nothing():
    packer = _NeverReadyPacker()
    _, _, reply, types = send_scattered_blocks(packer, "cpu", timeout_s=0.05)
    assert isinstance(reply, TimeoutError) and types == []
    assert packer.staging.num_free == 0  # given back only once a peer answered


@pytest.mark.gpu
def test_a_packed_move_of_a_device_pool_lands_in_the_peers_blocks():
    packer = KVPacker()
    pool, received, reply, _ = send_scattered_blocks(packer, "cuda")
    assert reply == m.KVBlocksStored(7, 70, 3)
    assert torch.equal(received[3:6], pool[[9, 2, 14]])
    graphs = packer.graphs_of(pool)  # the gather was a captured one, given back once answered
    assert graphs.num_free == len(graphs.sizes) * packer.graphs_per_size


@pytest.mark.gpu
def test_a_device_move_answered_with_an_error_gives_its_captured_gather_back():
    packer = KVPacker()
    pool, _, reply, _ = send_scattered_blocks(packer, "cuda", refuse=True)
    assert isinstance(reply, RemoteError)
    graphs = packer.graphs_of(pool)
    assert graphs.num_free == len(graphs.sizes) * packer.graphs_per_size and graphs.num_retired == 0


@pytest.mark.gpu
def test_a_device_move_whose_gather_is_late_retires_its_graph_until_the_device_passed_it():
    """The gather is queued behind a long kernel and the move gives up first: its graph is lent
    no more, and kept (its pinned ids with it) until the device has run its replay."""
    packer = KVPacker()

    def busy(pool):
        packer.prepare(pool)
        torch.cuda._sleep(100_000_000)

    pool, _, reply, types = send_scattered_blocks(packer, "cuda", timeout_s=0.01, before=busy)
    assert isinstance(reply, TimeoutError) and types == []
    graphs = packer.graphs_of(pool)
    assert graphs.num_retired == 1 and graphs.num_free == len(graphs.sizes) * packer.graphs_per_size - 1
    assert len(packer._retired) == 1
    torch.cuda.synchronize()
    _, buffers, ready = packer.pack(pool, [9, 2, 14], [3, 4, 5])  # the replay has run: let go
    assert packer._retired == []
    ready.synchronize()
    assert torch.equal(buffers[0], pool[[9, 2, 14]])


def _runs_by_walking(sources, destinations, max_run_blocks):
    """``destination_runs``'s contract, pair by pair."""
    runs = []
    for src, dst in zip(sources, destinations):
        if runs and dst == runs[-1][0] + len(runs[-1][1]) and (
                max_run_blocks is None or len(runs[-1][1]) < max_run_blocks):
            runs[-1][1].append(src)
        else:
            runs.append((dst, [src]))
    return [(dst, tuple(srcs)) for dst, srcs in runs]


@given(st.lists(st.integers(0, 500), min_size=1, max_size=40, unique=True), st.integers(0, 100),
       st.booleans(), st.one_of(st.none(), st.integers(1, 50)))
def test_destination_runs_of_one_reservation_or_many_follow_the_pairs(sources, start, consecutive, max_run_blocks):
    destinations = list(range(start, start + len(sources))) if consecutive else sorted(sources, reverse=True)
    runs = destination_runs(sources, destinations, max_run_blocks)
    assert [(r.dst_block_id, r.src_block_ids) for r in runs] == _runs_by_walking(sources, destinations,
                                                                                max_run_blocks)
