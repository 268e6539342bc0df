"""Pools a local peer reads in place: rows of a pool as a buffer (``PoolRows``), their place in
the frame (where 3), copying them out (``pull_rows``), the in-memory network that maps pools,
and on a GPU two processes whose moves go as row ids through CUDA IPC."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from infinite_llm.transport import codec
from infinite_llm.transport import messages as m
from infinite_llm.transport.device_pools import (
    REF_COUNTERS_PER_FILE,
    DevicePoolUnavailable,
    PoolRows,
    SharedPools,
    check_offer,
    open_pool,
    pull_rows,
    row_nbytes,
    row_words,
)
from infinite_llm.transport.errors import ProtocolError, RemoteError
from infinite_llm.transport.interface import TransportConfig
from infinite_llm.transport.kv_packing import HostStaging, KVPacker
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.tensors import TensorSpec

from conftest import run_bounded

LIMITS = codec.FrameLimits()
BLOCK_SHAPE = (2, 2, 16, 2, 8)  # as ucx_peer.py's pool: [num_layers, 2, block_size, num_kv_heads, head_dim]


def numbered_pool(num_blocks: int = 16, device: str = "cpu") -> torch.Tensor:
    """Block b holds the value b + 1 throughout."""
    values = torch.arange(1, num_blocks + 1, dtype=torch.float32, device=device)
    return values.view(-1, *([1] * len(BLOCK_SHAPE))).expand(num_blocks, *BLOCK_SHAPE).contiguous()


def blocks_message(rows: tuple[PoolRows | torch.Tensor, ...], dst_first: tuple[int, ...]) -> m.KVBlocks:
    runs = tuple(m.BlockRun(d, r.shape[0]) for d, r in zip(dst_first, rows))
    return m.KVBlocks(move_id=1, reservation_id=7, runs=runs, runs_data=rows)


# --- what is kept per shared pool ----------------------------------------------------------


def test_what_is_kept_for_a_pool_is_found_through_its_storage():
    pool = numbered_pool()
    kept = SharedPools()
    kept.put(pool, 3)
    assert kept.get(pool) == 3 and pool in kept and kept.values() == [3]
    assert kept.get(numbered_pool()) is None  # another pool


def test_another_storage_over_the_same_memory_and_layout_is_another_pool():
    # As a pool freed and made again at the same address: its key is the same, its memory
    # (CUDA's handle to it) may not be. torch.from_numpy makes a new storage each call.
    memory = np.zeros((8, 4), dtype=np.float32)
    first, second = torch.from_numpy(memory), torch.from_numpy(memory)
    assert first.untyped_storage() is not second.untyped_storage()
    kept = SharedPools()
    kept.put(first, 0)
    assert kept.get(second) is None and second not in kept
    del first
    assert kept.values() == []  # nothing kept for a storage that is gone
    kept.put(second, 1)
    assert kept.get(second) == 1 and len(kept) == 1


# --- PoolRows and pull_rows ----------------------------------------------------------------


def test_pool_rows_have_the_shape_of_their_gather_and_gather_to_it():
    pool = numbered_pool()
    scattered, consecutive = PoolRows(pool, [5, 2, 9]), PoolRows(pool, [3, 4, 5])
    assert scattered.shape == (3, *BLOCK_SHAPE) and scattered.dtype == torch.float32
    assert scattered.nbytes == 3 * pool[0].nbytes
    assert torch.equal(scattered.gather(), pool[[5, 2, 9]])
    gathered = consecutive.gather()
    assert gathered.data_ptr() == pool[3].data_ptr() and torch.equal(gathered, pool[3:6])  # a view


@pytest.mark.parametrize("rows", [[], [-1], [16], [0, 16]])
def test_pool_rows_outside_the_pool_are_refused(rows):
    with pytest.raises(ValueError):
        PoolRows(numbered_pool(), rows)


def test_a_pool_that_is_not_contiguous_makes_no_rows():
    with pytest.raises(ValueError):
        PoolRows(numbered_pool().transpose(0, 1), [0])


@pytest.mark.parametrize("rows", [[4, 5, 6], [9, 0, 3, 3]])
def test_pull_rows_copies_the_rows_into_a_view_of_another_pool(rows):
    source, destination = numbered_pool(), torch.zeros(20, *BLOCK_SHAPE)
    pull_rows(row_words(source), rows, destination[10:10 + len(rows)])
    assert torch.equal(destination[10:10 + len(rows)], source[rows])
    assert not destination[:10].any() and not destination[10 + len(rows):].any()


def test_a_bfloat16_pool_is_copied_bit_for_bit():
    source = torch.randn(8, 4, 3).to(torch.bfloat16)
    destination = torch.empty(2, 4, 3, dtype=torch.bfloat16)
    pull_rows(row_words(source), [6, 1], destination)
    assert torch.equal(destination.view(torch.int16), source[[6, 1]].view(torch.int16))


@pytest.mark.parametrize("nbytes, word", [(24, torch.int64), (12, torch.int32), (6, torch.int16), (5, torch.uint8)])
def test_rows_are_gathered_as_the_widest_words_that_divide_them(nbytes, word):
    source = torch.randint(0, 255, (6, nbytes), dtype=torch.uint8)
    words = row_words(source)
    assert words.dtype == word and row_nbytes(words) == nbytes
    destination = torch.zeros(2, nbytes, dtype=torch.uint8)
    pull_rows(words, [5, 0], destination)
    assert torch.equal(destination, source[[5, 0]])


def test_a_destination_off_the_words_alignment_gets_the_rows_as_bytes():
    source = torch.randint(0, 255, (6, 16), dtype=torch.uint8)
    words = row_words(source)
    assert words.dtype == torch.int64
    buffer = torch.zeros(1 + 2 * 16, dtype=torch.uint8)
    pull_rows(words, [4, 1], buffer[1:])  # one byte in: no 8-byte word starts there
    assert torch.equal(buffer[1:].view(2, 16), source[[4, 1]]) and buffer[0] == 0


def test_a_process_that_receives_into_host_memory_maps_no_pool():
    offer = m.DevicePoolOffer(pool_id=0, device=0, handle="00" * 64, storage_bytes=1 << 20, storage_offset_bytes=0,
                              ref_counter="00", ref_counter_offset=0, event="", event_sync_required=False,
                              dtype="float32", shape=(16, 4), offset=0)
    with pytest.raises(DevicePoolUnavailable, match="host memory"):
        open_pool(offer, torch.device("cpu"))


TORCH_REF_COUNTER = b"/torch_4242_3141592653_7".hex()  # as torch names its counters' files


@pytest.mark.parametrize("fields", [
    {"ref_counter_offset": REF_COUNTERS_PER_FILE},  # the mapped pool's deleter would write past the file
    {"ref_counter_offset": 1 << 40},
    {"ref_counter": b"/infllm-4242-0123456789abcdef".hex()},  # another file of this user's
    {"ref_counter": b"/torch_4242_1_2/../x".hex()},
    {"ref_counter": "00"},
    {"ref_counter": "zz"},
    {"dtype": "complex64"},
    {"shape": (1 << 20, 4)},  # more than the storage holds
])
def test_offers_whose_fields_torch_would_act_on_unchecked_are_refused_before_any_cuda_call(fields):
    """The receiver checks an offer before torch opens it: the reference counter torch's
    deleter decrements must be one of torch's files and within it."""
    base = dict(pool_id=0, device=0, handle="00" * 64, storage_bytes=1 << 20, storage_offset_bytes=0,
                ref_counter=TORCH_REF_COUNTER, ref_counter_offset=REF_COUNTERS_PER_FILE - 1, event="",
                event_sync_required=False, dtype="float32", shape=(16, 4), offset=0)
    dtype, _handle, ref_counter, event = check_offer(m.DevicePoolOffer(**base))
    assert dtype == torch.float32 and ref_counter == bytes.fromhex(TORCH_REF_COUNTER) and event is None
    with pytest.raises(DevicePoolUnavailable):
        check_offer(m.DevicePoolOffer(**{**base, **fields}))


@pytest.mark.parametrize("fields", [
    {"pool_id": -1}, {"shape": ()}, {"shape": (0, 4)}, {"storage_bytes": -1}, {"handle": "ab" * 300},
])
def test_malformed_offers_are_refused(fields):
    base = dict(pool_id=0, device=0, handle="00" * 64, storage_bytes=1 << 20, storage_offset_bytes=0,
                ref_counter="00", ref_counter_offset=0, event="", event_sync_required=False, dtype="float32",
                shape=(16, 4), offset=0)
    with pytest.raises(ValueError):
        m.DevicePoolOffer(**{**base, **fields})


# --- the frame: rows as their ids ----------------------------------------------------------


def test_rows_of_a_mapped_pool_travel_as_their_ids():
    pool = numbered_pool()
    message = blocks_message((PoolRows(pool, [7, 1]), PoolRows(pool, [3])), (0, 4))
    frame = codec.encode(message, msg_id=3, place_rows=lambda rows: 5)
    assert frame.buffers == ()  # nothing but the header
    header = codec.decode_header(frame.header, LIMITS)
    assert header.pool_rows == ((5, (7, 1)), (5, (3,)))
    assert header.num_wire_buffers == 0 and header.inline == (False, False)
    assert header.message.runs_data == (TensorSpec("float32", (2, *BLOCK_SHAPE)), TensorSpec("float32", (1, *BLOCK_SHAPE)))
    destinations = [torch.zeros(2, *BLOCK_SHAPE), torch.zeros(1, *BLOCK_SHAPE)]
    assert codec.land_inline(header, destinations) == []  # none to receive over UCX
    assert [(p, r) for _d, p, r in codec.pool_row_destinations(header, destinations)] == [(5, (7, 1)), (5, (3,))]


def test_rows_of_a_pool_the_peer_did_not_map_travel_gathered():
    pool = numbered_pool()
    message = blocks_message((PoolRows(pool, [7, 1]),), (0,))
    for place_rows in (None, lambda rows: None):
        frame = codec.encode(message, msg_id=3, place_rows=place_rows, inline_limit_bytes=0)
        header = codec.decode_header(frame.header, LIMITS)
        assert header.pool_rows == () and len(frame.buffers) == 1
        assert np.array_equal(np.asarray(frame.buffers[0]), pool[[7, 1]].reshape(-1).view(torch.uint8).numpy())


def kv_rows_frame(table: list, runs_data: list | None = None) -> bytes:
    body = {"t": "kv_blocks", "v": 3, "id": 1, "re": None,
            "f": {"move_id": 1, "reservation_id": 7, "runs": [[0, 2]], "commit_segment_id": -1,
                  "home_inst_id": -1, "req_id": -1},
            "x": {"runs_data": runs_data or [["float32", [2, 4]]]}, "b": table}
    import orjson
    data = orjson.dumps(body)
    return codec.header_bytes(data, flags=codec.FLAG_WANTS_REPLY)


def test_a_hand_made_rows_entry_decodes():
    header = codec.decode_header(kv_rows_frame([[32, 3, 2, [9, 4]]]), LIMITS)
    assert header.pool_rows == ((2, (9, 4)),) and header.num_wire_buffers == 0


@pytest.mark.parametrize("entry, code", [
    ([32, 3, 2, []], m.ErrorCode.INVALID_FIELDS),  # no rows
    ([32, 3, 2, [1, -1]], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2, [1, 2.0]], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2, [1, True]], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, -2, [1, 2]], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2, 5], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2, [1, 2], 0], m.ErrorCode.INVALID_FIELDS),
    ([32, 3, 2, [1, 2, 3]], m.ErrorCode.LENGTH_MISMATCH),  # 32 bytes are not 3 rows of one size
    ([16, 3, 2, [1, 2]], m.ErrorCode.LENGTH_MISMATCH),  # not the tensor's bytes
])
def test_malformed_rows_entries_are_refused(entry, code):
    with pytest.raises(ProtocolError) as info:
        codec.decode_header(kv_rows_frame([entry]), LIMITS)
    assert info.value.code == code


# --- in memory: a network whose transports map each other's pools --------------------------


def in_memory_pair(maps_pools: bool = True, receiver_pools: bool = True):
    network = InMemoryNetwork(maps_pools=maps_pools)
    sender = network.transport()
    receiver = network.transport(config=TransportConfig(device_pools=receiver_pools))
    destination_pool = torch.zeros(16, *BLOCK_SHAPE)
    seen: list[m.KVBlocks] = []

    def place(message):
        return [destination_pool[r.dst_block_id:r.dst_block_id + r.num_blocks] for r in message.runs] \
            if isinstance(message, m.KVBlocks) else None

    def handle(message):
        seen.append(message)
        return m.KVBlocksStored(message.move_id, message.reservation_id, sum(r.num_blocks for r in message.runs))
    return network, sender, receiver, destination_pool, seen, (handle, place)


@pytest.mark.parametrize("maps_pools, receiver_pools", [(True, True), (False, True), (True, False)])
def test_a_move_lands_the_same_whether_its_rows_are_pulled_or_gathered(maps_pools, receiver_pools):
    network, sender, receiver, destination_pool, seen, (handle, place) = in_memory_pair(maps_pools, receiver_pools)
    source = numbered_pool()
    staging = HostStaging()
    packer = KVPacker(staging)
    src, dst = [9, 2, 3, 4, 15], [0, 1, 2, 6, 7]

    async def scenario():
        await receiver.start(handle, place)
        await sender.start(lambda message: None)
        return await packer.send(sender, receiver.address, source, src, dst,
                                 lambda runs, data: m.KVBlocks(1, 7, runs, data), 5.0)
    stored = asyncio.run(scenario())
    assert stored == m.KVBlocksStored(1, 7, 5)
    assert torch.equal(destination_pool[dst], source[src])
    assert not destination_pool[[5, 8, 9]].any()
    # Pulled: nothing was gathered here (no staging buffer taken); gathered: one a run, given back.
    assert staging.num_free == (0 if maps_pools and receiver_pools else 2)
    assert [r.num_blocks for r in seen[0].runs] == [3, 2]


def test_rows_of_a_pool_the_receiver_never_mapped_are_refused():
    network, sender, receiver, _destination_pool, _seen, (handle, place) = in_memory_pair()
    source = numbered_pool()

    async def scenario():
        await receiver.start(handle, place)
        await sender.start(lambda message: None)
        assert await sender.map_device_pool(receiver.address, source)
        network._forget_pools(sender.address)  # as a sender whose memory is gone
        return await sender.request(receiver.address, blocks_message((PoolRows(source, [1, 2]),), (0,)))
    with pytest.raises(RemoteError) as info:
        asyncio.run(scenario())
    assert info.value.code == m.ErrorCode.INVALID_FIELDS and "never mapped" in info.value.detail


def test_a_closed_transports_pools_are_read_no_more():
    network, sender, receiver, _destination_pool, _seen, (handle, place) = in_memory_pair()

    async def scenario():
        await receiver.start(handle, place)
        await sender.start(lambda message: None)
        assert await sender.map_device_pool(receiver.address, numbered_pool())
        assert network._pools
        await sender.close()
    asyncio.run(scenario())
    assert network._pools == {}


# --- UCX ------------------------------------------------------------------------------------


def test_ucx_maps_no_host_pool(ucx_loop):
    pytest.importorskip("ucxx")
    from ucx_testlib import started

    async def scenario():
        async with started(lambda message: None) as receiver, started(lambda message: None) as sender:
            return await sender.map_device_pool(receiver.address, numbered_pool())
    assert run_bounded(ucx_loop, scenario(), 30) is False


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture
def cuda_peer(peer_command):
    from test_ucx_loopback import Peer
    peers = []

    def start(*args: str):
        peers.append(Peer(peer_command, "serve", "0", "--cuda", *args))
        return peers[-1]
    yield start
    for peer in peers:
        peer.kill()


def send_numbered_move(ucx_loop, peer, src: list[int], dst: list[int], **config):
    """Move blocks ``src`` of a pool whose block b holds dst's value + 1 (ucx_peer.py checks
    each destination block d holds d + 1) to reservation 7 of ``peer``; returns the reply and
    the ids of the pools the peer mapped."""
    from ucx_testlib import started
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")
    for s, d in zip(src, dst):
        pool[s] = d + 1
    packer = KVPacker(graphs_per_size=0)

    async def scenario():
        async with started(lambda message: None, receive_device="cuda", **config) as transport:
            reply = await packer.send(transport, peer.address, pool, src, dst,
                                      lambda runs, data: m.KVBlocks(1, 7, runs, data), 10.0)
            return reply, transport._outbound[peer.address].pools_out.values()
    return run_bounded(ucx_loop, scenario(), 60)


@pytest.mark.gpu
@needs_gpu
def test_a_local_peer_copies_a_moves_rows_out_of_the_mapped_pool(ucx_loop, cuda_peer):
    peer = cuda_peer()
    src, dst = [40, 3, 17, 18, 19, 5], [8, 9, 10, 11, 30, 31]
    reply, mapped = send_numbered_move(ucx_loop, peer, src, dst)
    assert reply == m.KVBlocksStored(1, 7, 6)
    assert mapped == [0]  # the pool went as its id: mapped over CUDA IPC


def maps(ucx_loop, peer, **config) -> bool:
    from ucx_testlib import started

    async def scenario():
        async with started(lambda message: None, receive_device="cuda", **config) as transport:
            return await transport.map_device_pool(peer.address, torch.zeros(64, *BLOCK_SHAPE, device="cuda"))
    return run_bounded(ucx_loop, scenario(), 60)


@pytest.mark.gpu
@needs_gpu
def test_a_peer_that_maps_no_pools_declines_the_offer(ucx_loop, cuda_peer):
    # Its moves then go gathered, over UCX (tested in memory: these tests' UCX has no CUDA).
    assert maps(ucx_loop, cuda_peer("--no-device-pools")) is False


@pytest.mark.gpu
@needs_gpu
def test_a_sender_with_pools_turned_off_offers_none(ucx_loop, cuda_peer):
    peer = cuda_peer()
    assert maps(ucx_loop, peer, device_pools=False) is False
    assert maps(ucx_loop, peer) is True


@pytest.mark.gpu
@needs_gpu
def test_rows_of_a_pool_id_the_peer_never_mapped_are_refused(ucx_loop, cuda_peer):
    from ucx_testlib import started

    peer = cuda_peer()
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")

    async def scenario():
        async with started(lambda message: None, receive_device="cuda") as transport:
            assert await transport.map_device_pool(peer.address, pool)
            transport._outbound[peer.address].pools_out.put(pool, 99)  # a forged id
            torch.cuda.synchronize()
            return await transport.request(peer.address, blocks_message((PoolRows(pool, [1, 2]),), (0,)))
    with pytest.raises(RemoteError) as info:
        run_bounded(ucx_loop, scenario(), 60)
    assert info.value.code == m.ErrorCode.INVALID_FIELDS and "pool 99" in info.value.detail


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("forge", [{"storage_bytes": 1 << 30}, {"storage_offset_bytes": 1 << 30}],
                         ids=["more-bytes", "offset-past-the-end"])
def test_an_offer_naming_memory_its_handle_does_not_map_is_declined(ucx_loop, cuda_peer, forge):
    """A peer's sizes are checked against what the driver mapped: a copy past it would fault
    the receiver's device context. The receiver goes on serving, and maps the true offer."""
    import dataclasses

    from ucx_testlib import started

    from infinite_llm.transport.device_pools import export_pool
    peer = cuda_peer()
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")
    offer = export_pool(pool, 5)
    forged = dataclasses.replace(offer, **{name: getattr(offer, name) + extra for name, extra in forge.items()})

    async def scenario():
        async with started(lambda message: None, receive_device="cuda") as transport:
            with pytest.raises(RemoteError) as info:
                await transport.request(peer.address, forged)
            return info.value, await transport.map_device_pool(peer.address, pool)
    refusal, mapped = run_bounded(ucx_loop, scenario(), 60)
    assert refusal.code == m.ErrorCode.DEVICE_POOL_UNAVAILABLE
    assert mapped is True


@pytest.mark.gpu
@needs_gpu
def test_a_receiver_on_a_gpu_has_its_pull_stream_and_a_slot_once_started(ucx_loop):
    from ucx_testlib import started

    async def scenario():
        async with started(lambda message: None, receive_device="cuda") as transport:
            stream, slots = transport._pull_streams[torch.device("cuda")]
            return isinstance(stream, torch.cuda.Stream), len(slots._free)
    assert run_bounded(ucx_loop, scenario(), 30) == (True, 1)


@pytest.mark.gpu
@needs_gpu
def test_a_frames_pulls_share_one_slot_that_is_used_again():
    from infinite_llm.transport.device_pools import PullSlots
    source = numbered_pool(16, "cuda")
    words = row_words(source)
    slots = PullSlots(torch.device("cuda"))
    taken = []
    for _attempt in range(2):
        slot = slots.take(5)
        destination = torch.zeros(5, *BLOCK_SHAPE, device="cuda")
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            pull_rows(words, [9, 2, 7], destination[:3], slot.index)
            pull_rows(words, [15, 0], destination[3:], slot.index)
            slot.event.record(stream)
        slot.event.synchronize()
        assert torch.equal(destination, source[[9, 2, 7, 15, 0]])
        slots.give_back(slot)
        taken.append(slot)
    assert taken[0] is taken[1]  # the same pinned and device ids, and event


OLD_PEER_SCRIPT = """
import asyncio
from infinite_llm.transport import messages as m
from infinite_llm.transport.interface import TransportConfig
from infinite_llm.transport.ucx import UcxTransport
del m.MESSAGE_TYPES["device_pool_offer"]  # a peer that predates device pools

async def main():
    transport = UcxTransport(TransportConfig())
    await transport.start(lambda message: m.EchoReply(message.payload) if isinstance(message, m.Echo) else None)
    print(f"PORT {transport.address.port}", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


class OfferedPool:
    """A host tensor passed off as a device pool, to drive the offer over UCX without a GPU:
    the offer is made (``export_pool`` replaced), and a receiver on the CPU declines it."""

    def __init__(self) -> None:
        self.tensor = numbered_pool()
        self.is_cuda = True
        self.device, self.shape, self.dtype = self.tensor.device, self.tensor.shape, self.tensor.dtype

    def data_ptr(self) -> int:
        return self.tensor.data_ptr()

    def untyped_storage(self):
        return self.tensor.untyped_storage()


def fake_offer(pool, pool_id: int) -> m.DevicePoolOffer:
    return m.DevicePoolOffer(pool_id=pool_id, device=0, handle="00" * 64, storage_bytes=pool.tensor.nbytes,
                             storage_offset_bytes=0, ref_counter="00", ref_counter_offset=0, event="",
                             event_sync_required=False, dtype="float32", shape=tuple(pool.shape), offset=0)


def offering_transport(monkeypatch, exchange):
    """A UCX transport (never started) whose offers go through ``exchange`` on a connection
    of plain fields: the offer's sharing among callers, without a GPU or a peer."""
    import time
    import types

    from infinite_llm.transport import ucx
    from infinite_llm.transport.device_pools import SharedPools
    monkeypatch.setattr(ucx, "export_pool", fake_offer)
    transport = ucx.UcxTransport(TransportConfig(request_timeout_s=0.5))
    connection = types.SimpleNamespace(pools_out=SharedPools(), pool_offers={}, pools_declined=SharedPools(),
                                       broken=False)

    async def connection_for(peer, type_, timeout_s):
        return connection, time.monotonic() + timeout_s
    transport._connection_for = connection_for
    transport._encode_request = lambda message, connection, **kwargs: None
    transport._exchange = exchange
    return transport, connection


def test_a_caller_that_gives_up_on_an_offer_leaves_it_to_the_next(monkeypatch):
    from infinite_llm.transport.errors import RequestTimeout
    from infinite_llm.transport.interface import PeerAddress
    peer = PeerAddress("127.0.0.1", 9)

    async def exchange(*args):
        await asyncio.sleep(0.1)  # the peer maps it, slowly
        return m.Ack()
    transport, connection = offering_transport(monkeypatch, exchange)
    pool = OfferedPool()

    async def scenario():
        with pytest.raises(RequestTimeout):
            await transport.map_device_pool(peer, pool, timeout_s=0.02)
        later = await transport.map_device_pool(peer, pool, timeout_s=1)
        return later, connection.pools_out.values(), connection.pool_offers
    assert asyncio.run(scenario()) == (True, [0], {})


def test_an_offer_that_fails_after_every_caller_gave_up_leaves_no_unread_error(monkeypatch):
    import gc

    from infinite_llm.transport.errors import PeerUnreachable, RequestTimeout
    from infinite_llm.transport.interface import PeerAddress
    peer = PeerAddress("127.0.0.1", 9)

    async def exchange(*args):
        await asyncio.sleep(0.05)
        raise PeerUnreachable(peer, "connection broke")
    transport, connection = offering_transport(monkeypatch, exchange)
    pool = OfferedPool()

    async def scenario():
        unread = []
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unread.append(context))
        with pytest.raises(RequestTimeout):
            await transport.map_device_pool(peer, pool, timeout_s=0.01)
        await asyncio.sleep(0.2)
        gc.collect()  # an unread task error is reported when the task is collected
        await asyncio.sleep(0)
        return unread, connection.pool_offers
    assert asyncio.run(scenario()) == ([], {})


def test_a_peer_that_predates_device_pools_is_not_offered_one_again(ucx_loop, peer_command, monkeypatch):
    """It closes the connection on the unknown offer: the sender hears no, remembers the peer,
    and its next request connects afresh."""
    import sys

    from test_ucx_loopback import Peer

    from ucx_testlib import started

    from infinite_llm.transport import ucx
    monkeypatch.setattr(ucx, "export_pool", fake_offer)
    peer = Peer([sys.executable, "-c", OLD_PEER_SCRIPT])
    pool = OfferedPool()

    async def scenario():
        async with started(lambda message: None) as transport:
            first = await transport.map_device_pool(peer.address, pool)
            second = await transport.map_device_pool(peer.address, pool)
            return first, second, await transport.request(peer.address, m.Echo(torch.arange(4)))
    try:
        first, second, echo = run_bounded(ucx_loop, scenario(), 60)
    finally:
        peer.kill()
    assert first is False and second is False and torch.equal(echo.payload, torch.arange(4))


def test_a_receiver_on_the_host_declines_a_device_pool(ucx_loop, peer_command, monkeypatch):
    from test_ucx_loopback import Peer

    from ucx_testlib import started

    from infinite_llm.transport import ucx
    monkeypatch.setattr(ucx, "export_pool", fake_offer)
    peer = Peer(peer_command, "serve")
    pool = OfferedPool()

    async def scenario():
        async with started(lambda message: None) as transport:
            mapped = await transport.map_device_pool(peer.address, pool)
            connection = transport._outbound[peer.address]
            return mapped, connection.broken, connection.pools_out.values(), connection.pools_declined.values()
    try:
        mapped, broken, pools_out, declined = run_bounded(ucx_loop, scenario(), 60)
    finally:
        peer.kill()
    assert mapped is False and not broken and pools_out == [] and declined == [True]


def test_a_destination_whose_words_do_not_line_up_gets_the_rows_as_bytes():
    source = torch.randint(0, 255, (6, 16), dtype=torch.uint8)
    backing = bytearray(40)
    destination = torch.frombuffer(memoryview(backing)[1:33], dtype=torch.uint8)  # off any word
    pull_rows(row_words(source), [5, 2], destination)
    assert torch.equal(destination.view(2, 16), source[[5, 2]]) and backing[0] == 0


@pytest.mark.gpu
@needs_gpu
def test_a_failed_frames_slot_is_kept_until_the_device_passed_its_copies():
    from infinite_llm.transport.device_pools import PullSlots
    slots = PullSlots(torch.device("cuda"))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        slot = slots.take(4)
        torch.cuda._sleep(200_000_000)  # copies still queued behind this
        slot.event.record(stream)
    slots.retire(slot, object())
    slots.take(1)
    assert slots.num_retired == 1
    slot.event.synchronize()
    slots.take(1)
    assert slots.num_retired == 0


# --- pulls replayed from captured graphs ---------------------------------------------------


def test_a_destination_is_found_as_rows_of_its_storage():
    from infinite_llm.transport.device_pools import destination_rows_of
    source = row_words(numbered_pool(4))
    row_bytes = row_nbytes(source)
    pool = torch.zeros(64, *BLOCK_SHAPE)
    key, first = destination_rows_of(pool[9:12], source)
    assert first == 9
    assert key == (pool.untyped_storage().data_ptr(), pool.untyped_storage().nbytes(), 0, row_bytes, source.dtype)
    # A pool that begins part-way into its storage: rows counted from the storage's start, with
    # the pool's offset as the rows' phase.
    storage = torch.zeros(64 * row_bytes + 24, dtype=torch.uint8)
    shifted = storage[24:].view(torch.float32).view(64, *BLOCK_SHAPE)
    key, first = destination_rows_of(shifted[5:7], source)
    assert (key[2], first) == (24, 5)


def test_a_destination_the_words_do_not_line_up_with_is_not_taken_as_rows():
    from infinite_llm.transport.device_pools import destination_rows_of
    source = row_words(numbered_pool(4))  # rows of 8-byte words
    storage = torch.zeros(8 * row_nbytes(source) + 4, dtype=torch.uint8)
    assert destination_rows_of(storage[4:4 + row_nbytes(source)], source) is None
    assert destination_rows_of(torch.zeros(4, 8).t(), source) is None  # not contiguous


@pytest.mark.parametrize("num_rows, capacity", [(1, 2), (2, 2), (3, 4), (64, 64), (65, 128)])
def test_a_pull_is_captured_for_the_next_power_of_two_rows(num_rows, capacity):
    from infinite_llm.transport.device_pools import pull_capacity
    assert pull_capacity(num_rows) == capacity


def test_rows_of_host_pools_are_never_pulled_through_a_graph():
    from infinite_llm.transport.device_pools import PullGraphs
    source = row_words(numbered_pool(16))
    destination_pool = torch.zeros(64, *BLOCK_SHAPE)
    graphs = PullGraphs()
    assert graphs.lend([source], [(destination_pool[0:3], 0, (4, 9, 2))]) is None
    assert graphs.num_made == 0


def pulled_through_graphs(graphs, source, destination_pool, frames):
    """Each frame's pulls (destination first row, source rows) through ``graphs`` on a stream of
    their own, waited for; the graphs used."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    words = row_words(source)
    used = []
    for frame in frames:
        pulls = [(destination_pool[first:first + len(rows)], 0, tuple(rows)) for first, rows in frame]
        with torch.cuda.stream(stream):
            graph = graphs.lend([words] * len(pulls), pulls)
            assert graph is not None
            graph.replay()
        graph.event.synchronize()
        graphs.give_back(graph)
        used.append(graph)
    return used


@pytest.mark.gpu
@needs_gpu
def test_a_frames_rows_land_through_one_captured_graph_used_again_and_touch_nothing_else():
    from infinite_llm.transport.device_pools import PullGraphs
    source = numbered_pool(32, "cuda")
    destination_pool = torch.full((64, *BLOCK_SHAPE), -1.0, device="cuda")
    graphs = PullGraphs()
    # Five rows in two pulls (a graph of eight: the last pair repeated), then three rows in one
    # (a graph of four), then five again: the first graph, free once the device passed it.
    frames = [[(10, [9, 2, 7]), (40, [31, 0])], [(20, [5, 6, 30])], [(50, [1, 2, 3, 4, 11])]]
    used = pulled_through_graphs(graphs, source, destination_pool, frames)
    assert used[2] is used[0] and used[1] is not used[0]
    assert graphs.num_made == 2
    expected = torch.full_like(destination_pool, -1.0)
    for frame in frames:
        for first, rows in frame:
            expected[first:first + len(rows)] = source[rows]
    assert torch.equal(destination_pool, expected)


@pytest.mark.gpu
@needs_gpu
def test_rows_land_in_a_pool_that_begins_part_way_into_its_storage():
    from infinite_llm.transport.device_pools import PullGraphs
    source = numbered_pool(32, "cuda")
    row_bytes = row_nbytes(row_words(source))
    storage = torch.full((64 * row_bytes + 24,), 0xFF, dtype=torch.uint8, device="cuda")
    pool = storage[24:].view(torch.float32).view(64, *BLOCK_SHAPE)
    graphs = PullGraphs()
    pulled_through_graphs(graphs, source, pool, [[(5, [3, 1, 30])]])
    assert graphs.num_made == 1
    assert torch.equal(pool[5:8], source[[3, 1, 30]])
    assert torch.all(storage[:24] == 0xFF) and torch.all(pool[:5].view(torch.uint8) == 0xFF)
    assert torch.all(pool[8:].view(torch.uint8) == 0xFF)


@pytest.mark.gpu
@needs_gpu
def test_frames_a_graph_does_not_serve_are_left_to_the_eager_pull():
    from infinite_llm.transport.device_pools import PullGraphs
    source = row_words(numbered_pool(32, "cuda"))
    other = row_words(numbered_pool(32, "cuda"))
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")
    big = torch.zeros(64, *BLOCK_SHAPE, device="cuda")
    graphs = PullGraphs()
    fresh = torch.zeros(3, *BLOCK_SHAPE, device="cuda")  # a frame's own buffer: no pool
    assert graphs.lend([source], [(fresh, 0, (1, 5, 3))]) is None
    assert graphs.lend([source, other], [(pool[0:1], 0, (1,)), (pool[1:2], 1, (2,))]) is None  # two pools
    assert graphs.lend([source, source], [(pool[0:1], 0, (1,)), (big[0:1], 0, (2,))]) is None  # two storages
    assert graphs.lend([source, source], [(pool[0:2], 0, (1, 4)), (pool[1:3], 0, (2, 6))]) is None  # overlapping
    assert graphs.lend([source], [(pool[0:3], 0, (4, 5, 6))]) is None  # consecutive rows: one copy
    assert graphs.lend([source], [(torch.zeros(64, *BLOCK_SHAPE)[0:2], 0, (1, 4))]) is None  # on the host
    assert graphs.num_made == 0


@pytest.mark.gpu
@needs_gpu
def test_graphs_lent_to_frames_still_landing_are_not_lent_again_and_are_bounded():
    from infinite_llm.transport.device_pools import PullGraphs
    numbered = numbered_pool(32, "cuda")
    source = row_words(numbered)
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")
    graphs = PullGraphs(per_shape=2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        lent = [graphs.lend([source], [(pool[2 * i:2 * i + 2], 0, (i + 1, i))]) for i in range(3)]
    assert lent[0] is not None and lent[1] is not None and lent[0] is not lent[1]
    assert lent[2] is None  # both of its shape are lent: pulled eagerly instead
    stream.synchronize()
    graphs.retire(lent[0])  # a failed frame's: another may be made in its place
    graphs.give_back(lent[1])
    assert graphs.num_made == 1
    with torch.cuda.stream(stream):
        again = [graphs.lend([source], [(pool[8:10], 0, (4, 3))]) for _ in range(2)]
        for graph in again:
            graph.replay()
    assert again[0] is lent[1] and again[1] is not None
    assert graphs.num_made == 2
    stream.synchronize()
    assert torch.equal(pool[8:10], numbered[[4, 3]])


@pytest.mark.gpu
@needs_gpu
def test_at_the_limit_of_graphs_the_one_used_least_recently_goes():
    from infinite_llm.transport.device_pools import PullGraphs
    source = numbered_pool(32, "cuda")
    pool = torch.zeros(128, *BLOCK_SHAPE, device="cuda")
    graphs = PullGraphs(max_graphs=2)
    frames = [[(0, [2, 1])], [(4, [9, 2, 7])], [(0, [5, 1])], [(8, [3, 1, 4, 1, 5])]]
    used = pulled_through_graphs(graphs, source, pool, frames)
    # Sizes 2, 4, 2 again (the first graph), then 8: the graph of 4 rows, used least recently, goes.
    assert used[2] is used[0] and graphs.num_made == 2
    assert used[0].key in graphs._free and used[1].key not in graphs._free
    assert torch.equal(pool[8:13], source[[3, 1, 4, 1, 5]])


@pytest.mark.gpu
@needs_gpu
def test_a_capture_that_fails_turns_the_graphs_off(monkeypatch):
    from infinite_llm.transport import device_pools
    source = row_words(numbered_pool(32, "cuda"))
    pool = torch.zeros(64, *BLOCK_SHAPE, device="cuda")

    def refuse(graph, memory_pool, body):
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(device_pools, "capture", refuse)
    graphs = device_pools.PullGraphs()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert graphs.lend([source], [(pool[0:2], 0, (3, 1))]) is None
    assert graphs.off and graphs.num_made == 0
    monkeypatch.undo()
    with torch.cuda.stream(stream):
        assert graphs.lend([source], [(pool[0:2], 0, (3, 1))]) is None  # off for good


@pytest.mark.gpu
@needs_gpu
def test_a_failed_capture_leaves_the_stream_and_the_allocator_as_they_were():
    from infinite_llm.transport.graph_capture import capture
    memory_pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream()
    x = torch.ones(1024, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(stream):
        with pytest.raises(RuntimeError):
            capture(torch.cuda.CUDAGraph(), memory_pool, lambda: torch.cuda.synchronize())  # not capturable
        assert not torch.cuda.is_current_stream_capturing()
        # No allocation is routed into the failed capture's pool any more.
        with pytest.raises(RuntimeError):
            torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), memory_pool)
        graph = torch.cuda.CUDAGraph()
        out = torch.empty_like(x)
        capture(graph, torch.cuda.graph_pool_handle(), lambda: torch.mul(x, 3, out=out))
        graph.replay()
    stream.synchronize()
    assert torch.equal(out, torch.full_like(x, 3.0))
