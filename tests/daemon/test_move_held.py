"""A creditor-to-creditor move on the in-memory transport: the home H moves its segment held by
D to X (``TransportLender.move_held``; D sends with ``forward_segment``). The whole trace of
messages is asserted, and each failure leaves H's table as it was."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import pytest
import torch

from infinite_llm.daemon.ledger import CreditorLedger
from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.daemon.peers import PeerDirectory, TransportLender, forward_segment
from infinite_llm.engine.block_manager import BlockManager, Segment
from infinite_llm.transport.errors import PlacementRefused
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.kv_packing import KVPacker
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.messages import (
    ForwardSegment,
    FreeSegment,
    KVBlocks,
    KVBlocksStored,
    MoveCommit,
    MoveRejected,
    MoveRejectReason,
    MoveReserved,
    TryMoveKV,
)

H, D, X = 1, 2, 3  # cluster ids; the address of instance i is ("memory", i)
BLOCK_SIZE = 4
BLOCK_SHAPE = (2, 2, BLOCK_SIZE, 1, 2)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


def address(inst_id: int) -> PeerAddress:
    return PeerAddress("memory", inst_id)


class Creditor:
    """The creditor side of an instance, as ``infinited`` serves it, over a small pool."""

    def __init__(self, network: InMemoryNetwork, inst_id: int, num_blocks: int) -> None:
        self.pool = torch.zeros(num_blocks, *BLOCK_SHAPE)
        self.packer = KVPacker()
        free = list(range(num_blocks))
        self.ledger = CreditorLedger(
            allocate=lambda n: [free.pop(0) for _ in range(n)] if n <= len(free) else None,
            free=lambda ids: free.extend(ids), reservation_ttl_s=5.0)
        self.free = free
        self.transport = network.transport(address(inst_id))

    async def start(self) -> None:
        await self.transport.start(self.handle, self.place)

    async def handle(self, message):
        if isinstance(message, TryMoveKV):
            reservation = self.ledger.reserve(message.home_inst_id, message.req_id, message.num_blocks, 0.0)
            if reservation is None:
                return MoveRejected(message.move_id, MoveRejectReason.NO_SPACE, len(self.free))
            return MoveReserved(message.move_id, reservation.reservation_id, reservation.block_ids, 5000)
        if isinstance(message, KVBlocks):
            return KVBlocksStored(message.move_id, message.reservation_id, sum(r.num_blocks for r in message.runs))
        if isinstance(message, MoveCommit):
            self.ledger.commit(message.reservation_id, message.home_inst_id, message.req_id, message.segment_id, 0.0)
            return None
        if isinstance(message, FreeSegment):
            self.ledger.free_segment(message.home_inst_id, message.req_id, message.segment_id, message.reservation_id)
            return None
        if isinstance(message, ForwardSegment):
            return await forward_segment(self.transport, self.ledger, self.pool, message, timeout_s=5.0,
                                         packer=self.packer)
        raise ValueError(f"not served: {message.TYPE}")

    def place(self, message):
        if not isinstance(message, KVBlocks):
            return None
        reservation = self.ledger.reservations.get(message.reservation_id)
        if reservation is None:
            raise PlacementRefused(f"no reservation {message.reservation_id}")
        return [self.pool[r.dst_block_id:r.dst_block_id + r.num_blocks] for r in message.runs]


class Setup:
    """H's request "7" has tokens 0..7 (blocks 5, 6 of D, segment 0) and 8..11 at home."""

    def __init__(self, x_blocks: int = 8) -> None:
        self.network = InMemoryNetwork()
        self.d = Creditor(self.network, D, 8)
        self.x = Creditor(self.network, X, x_blocks)
        self.peers = PeerDirectory(H)
        self.src = self.peers.update(D, address(D), 8, False)
        self.dst = self.peers.update(X, address(X), x_blocks, False)
        self.bm = BlockManager(BLOCK_SIZE, [4])
        self.bm.allocate("7", 12)
        self.engine = SimpleNamespace(block_manager=self.bm, pools={0: torch.zeros(4, *BLOCK_SHAPE)},
                                      config=SimpleNamespace(block_size=BLOCK_SIZE), home_instance_id=0)
        self.home = self.network.transport(address(H))
        self.lender = TransportLender(self.home, self.peers, InstanceMetrics(), timeout_s=5.0)
        # D holds the segment: its blocks 5 and 6, filled with recognisable data.
        for _ in range(5):
            self.d.free.pop(0)
        reservation = self.d.ledger.reserve(H, 7, 2, 0.0)
        self.d.ledger.commit(reservation.reservation_id, H, 7, 0, 0.0)
        self.d.pool[5], self.d.pool[6] = 1.5, 2.5
        self.bm.commit_move(self.bm.lend_to_remote("7", self.src.engine_id, (5, 6), num_written=12,
                                                   copy_id=reservation.reservation_id))

    async def start(self) -> None:
        await self.d.start()
        await self.x.start()

        async def serves_nothing(message):
            raise ValueError("the home serves nothing here")
        await self.home.start(serves_nothing)

    def move_held(self, num_blocks: int = 2) -> bool:
        """The home's ``move_held`` of ``num_blocks`` of "7" from D to X, the network settled after."""
        async def scenario() -> bool:
            await self.start()
            moved = await self.lender.move_held(self.engine, "7", num_blocks, self.src, self.dst, epoch=4)
            await self.network.settle()
            return moved
        return asyncio.run(scenario())

    def types(self) -> list[tuple[int, int, str]]:
        return [(int(src.rsplit(":", 1)[-1]), int(dst.rsplit(":", 1)[-1]), t) for src, dst, t in self.network.messages()]


def test_the_home_moves_a_held_segment_to_another_creditor() -> None:
    s = Setup()

    async def scenario() -> bool:
        await s.start()
        moved = await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4)
        await s.network.settle()
        return moved

    assert asyncio.run(scenario()) is True
    x_copy = s.x.ledger.held[(H, 7, 0)].reservation_id
    assert s.bm.block_table("7") == (Segment(s.dst.engine_id, (0, 1), 0, 8, x_copy), Segment(0, (2,), 8, 4))
    assert [(k, len(v.block_ids)) for k, v in s.x.ledger.held.items()] == [((H, 7, 0), 2)]
    assert torch.all(s.x.pool[0] == 1.5) and torch.all(s.x.pool[1] == 2.5)
    assert s.d.ledger.held == {} and sorted(s.d.free) == [5, 6, 7]  # 0..4 stand for other work
    assert s.types() == [
        (H, X, "try_move_kv"), (X, H, "move_reserved"),
        (H, D, "forward_segment"), (D, X, "kv_blocks"), (X, D, "kv_blocks_stored"), (D, H, "kv_blocks_stored"),
        (H, X, "move_commit"), (X, H, "ack"),
        (H, D, "free_segment")]  # only after the table points at X


def test_a_refusal_at_the_destination_changes_nothing() -> None:
    s = Setup(x_blocks=1)
    before = s.bm.block_table("7")
    assert s.move_held() is False
    assert s.bm.block_table("7") == before
    assert list(s.d.ledger.held) == [(H, 7, 0)] and s.x.ledger.reservations == {} and s.x.ledger.held == {}
    assert s.dst.num_blocks_free == 1  # learnt from the refusal


def test_a_failed_forward_leaves_the_table_and_the_reservation_expires() -> None:
    s = Setup()
    s.d.ledger.held.clear()  # D lost the segment (say, its home went silent for a while)
    before = s.bm.block_table("7")

    async def scenario() -> bool:
        await s.start()
        return await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4)

    assert asyncio.run(scenario()) is False
    assert s.bm.block_table("7") == before
    assert s.x.ledger.held == {} and len(s.x.ledger.reservations) == 1  # never committed
    assert len(s.x.ledger.release_expired(now=10.0)) == 1 and sorted(s.x.free) == list(range(8))


def test_a_new_copy_at_the_segments_place_before_the_switch_is_kept_and_the_moved_one_freed() -> None:
    """Between X's commit and the step boundary of the switch, the request was preempted,
    prefilled again and spilled to D once more: the new copy is not the one moved. The table
    keeps it, and X frees the committed copy nobody counts on."""
    s = Setup()

    async def respilled_then_switch(switch) -> None:
        s.bm.free("7")
        s.bm.allocate("7", 12)
        s.bm.commit_move(s.bm.lend_to_remote("7", s.src.engine_id, (5, 6), num_written=12, copy_id=99))
        switch()

    async def scenario() -> bool:
        await s.start()
        moved = await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4, at_step_boundary=respilled_then_switch)
        await s.network.settle()
        return moved

    assert asyncio.run(scenario()) is False
    assert s.bm.block_table("7")[0] == Segment(s.src.engine_id, (5, 6), 0, 8, 99)
    assert s.x.ledger.held == {} and sorted(s.x.free) == list(range(8))  # the moved copy freed there
    assert (H, X, "free_segment") in s.types() and (H, D, "free_segment") not in s.types()


def move_held_refusal(s: Setup, num_blocks: int, dst) -> str:
    """Why ``move_held`` of ``num_blocks`` from D to ``dst`` is refused (it must be)."""
    async def scenario() -> None:
        await s.start()
        await s.lender.move_held(s.engine, "7", num_blocks, s.src, dst, epoch=4)

    with pytest.raises(ValueError) as info:
        asyncio.run(scenario())
    return str(info.value)


def test_only_whole_segments_that_fit_move() -> None:
    s = Setup()
    assert "no whole segment of at most 1 blocks" in move_held_refusal(s, 1, s.dst)
    assert s.network.messages() == []


class HomeMove:
    """H's request "7" has 20 written tokens in H's pool of 6 blocks; X has ``x_blocks`` free and
    H's figure for it is ``figure``."""

    def __init__(self, x_blocks: int, figure: int) -> None:
        self.network = InMemoryNetwork()
        self.x = Creditor(self.network, X, x_blocks)
        self.bm = BlockManager(BLOCK_SIZE, [6])
        self.bm.allocate("7", 20)
        self.pool = torch.arange(6 * math.prod(BLOCK_SHAPE), dtype=torch.float32).reshape(6, *BLOCK_SHAPE)
        self.engine = SimpleNamespace(block_manager=self.bm, pools={0: self.pool},
                                      config=SimpleNamespace(block_size=BLOCK_SIZE), home_instance_id=0,
                                      num_written_tokens=lambda: {"7": 20})
        self.home = self.network.transport(address(H))
        self.peers = PeerDirectory(H)
        self.dst = self.peers.update(X, address(X), figure, False)
        self.lender = TransportLender(self.home, self.peers, InstanceMetrics(), timeout_s=5.0)

    def move(self, num_blocks: int) -> int:
        """Blocks moved by the home's ``move`` of ``num_blocks`` of "7" to X."""
        async def scenario() -> int:
            await self.x.start()

            async def serves_nothing(message):
                raise ValueError("the home serves nothing here")
            await self.home.start(serves_nothing)
            return await self.lender.move(self.engine, "7", num_blocks, self.dst)

        return asyncio.run(scenario())


def test_a_home_move_refused_for_room_asks_again_for_what_is_free() -> None:
    """The home's figure for X is stale (8 free; X has 2): the first try-move of 4 blocks is
    refused with X's real figure, the second asks for those 2, and they move."""
    s = HomeMove(x_blocks=2, figure=8)
    oldest = s.bm.block_table("7")[0].block_ids[:2]
    assert s.move(4) == 2
    tries = [m for _, _, m in s.network.messages() if m == "try_move_kv"]
    assert len(tries) == 2 and s.dst.num_blocks_free == 0  # none left there: no third try
    table = s.bm.block_table("7")
    assert (table[0].instance_id, table[0].token_start, table[0].token_end) == (s.dst.engine_id, 0, 2 * BLOCK_SIZE)
    assert torch.equal(s.x.pool[list(table[0].block_ids)], s.pool[list(oldest)])


def test_an_ordered_move_waits_for_a_move_of_the_same_request_under_way() -> None:
    """``until_not_moving`` returns once the other move's switch is done, or False at its bound."""
    lender = TransportLender(InMemoryNetwork().transport(address(H)), PeerDirectory(H), InstanceMetrics(), timeout_s=5.0)

    async def scenario() -> tuple[bool, float, bool]:
        lender._moving.add("7")
        asyncio.get_running_loop().call_later(0.05, lender._moving.discard, "7")
        started = asyncio.get_running_loop().time()
        freed = await lender.until_not_moving("7", timeout_s=5.0)
        waited = asyncio.get_running_loop().time() - started
        lender._moving.add("8")
        return freed, waited, await lender.until_not_moving("8", timeout_s=0.05)

    freed, waited, still_moving = asyncio.run(scenario())
    assert freed and 0.04 <= waited < 1.0
    assert not still_moving


def test_a_home_move_takes_its_blocks_off_the_peers_figure_once_and_its_hold_first() -> None:
    """The home's figure for X drops by the blocks a move took there, once (not again at the
    switch), and only by those beyond what X kept for the request: X's figure left its holds
    out already. Counted twice, a home's later spills found no room that X still had."""
    def moved_figure(figure: int, hold: int) -> tuple[int, int]:
        s = HomeMove(x_blocks=8, figure=figure)
        if hold:
            s.lender._holds["7"] = {X: hold}
        assert s.move(3) == 3
        return s.dst.num_blocks_free, s.lender.held_on("7", X)

    assert moved_figure(8, hold=0) == (5, 0)
    assert moved_figure(6, hold=2) == (5, 0)  # two of the three came out of the hold
    assert moved_figure(4, hold=5) == (4, 2)  # all three did


def test_a_move_from_a_creditor_to_itself_is_refused() -> None:
    """A command naming one creditor as source and destination would have it commit a copy of
    a segment it holds, and the home free the only copy."""
    s = Setup()
    assert "to itself" in move_held_refusal(s, 2, s.src)
    assert s.network.messages() == [] and list(s.d.ledger.held) == [(H, 7, 0)]


def test_a_refused_commit_frees_nothing_at_the_destination() -> None:
    """The destination refuses the commit (an error reply): nothing was committed there, so
    the home sends it no FreeSegment (which would free any segment it holds under that name)."""
    s = Setup()
    serve = s.x.handle

    async def refuse_commits(message):
        if isinstance(message, MoveCommit):
            raise ValueError("no such reservation")
        return await serve(message)
    s.x.handle = refuse_commits
    before = s.bm.block_table("7")
    assert s.move_held() is False
    assert s.bm.block_table("7") == before and list(s.d.ledger.held) == [(H, 7, 0)]
    assert (H, X, "free_segment") not in s.types() and (H, D, "free_segment") not in s.types()


def test_a_try_move_answered_with_something_else_fails_the_move_only() -> None:
    """A peer that answers a try-move with anything but a reservation of the blocks asked for:
    the move fails (counted), the request's table stays, nothing is raised into the engine."""
    s = Setup()
    serve = s.x.handle

    async def answer_wrongly(message):
        if isinstance(message, TryMoveKV):
            return MoveReserved(message.move_id, 99, (0,), 5000)  # one block of the two
        return await serve(message)
    s.x.handle = answer_wrongly
    before = s.bm.block_table("7")
    assert s.move_held() is False
    assert s.bm.block_table("7") == before

    home = HomeMove(x_blocks=8, figure=8)
    home.x.handle = lambda message: MoveReserved(message.move_id, 99, (0,), 5000)
    assert home.move(3) == 0 and home.bm.block_table("7")[0].instance_id == 0


def test_a_free_that_cannot_be_sent_is_sent_again(monkeypatch) -> None:
    """The creditor is unreachable when its segment is freed (busy in a long step, or
    restarting): the home sends the FreeSegment again, and the creditor frees it once it is
    back. It would not free it of itself: it hears from the live home at every tick."""
    from infinite_llm.daemon import peers as peers_module
    monkeypatch.setattr(peers_module, "FREE_RETRY_PAUSES_S", (0.01, 0.01, 0.05))
    s = Setup()

    async def scenario() -> None:
        async def serves_nothing(message):
            raise ValueError("the home serves nothing here")
        await s.home.start(serves_nothing)
        s.lender._free_later(s.src, FreeSegment(H, 7, 0, s.bm.block_table("7")[0].copy_id))  # D is not listening yet
        await asyncio.sleep(0.005)
        assert list(s.d.ledger.held) == [(H, 7, 0)]
        await s.d.start()
        await asyncio.sleep(0.2)
        await s.network.settle()
        await s.lender.close()

    asyncio.run(scenario())
    assert s.d.ledger.held == {}


def test_the_switch_waits_for_a_step_boundary_and_the_source_frees_only_after_it() -> None:
    """Run in the background (``at_step_boundary``), the move sends and commits while steps go
    on: the table keeps naming D, and D keeps its copy, until the engine loop reaches a step
    boundary and switches; a second move of the request meanwhile is refused."""
    s = Setup()
    boundary: list[tuple] = []

    async def at_step_boundary(function):
        ran = asyncio.get_running_loop().create_future()
        boundary.append((function, ran))
        return await ran

    async def scenario():
        await s.start()
        task = asyncio.ensure_future(s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4,
                                                       at_step_boundary=at_step_boundary))
        for _ in range(200):  # the data travels and X commits; no boundary yet
            await s.network.settle()
            if boundary:
                break
        assert len(boundary) == 1 and not task.done()
        assert s.bm.block_table("7")[0].instance_id == s.src.engine_id
        assert (H, 7, 0) in s.d.ledger.held and (H, 7, 0) in s.x.ledger.held
        with pytest.raises(ValueError, match="under way"):
            await s.lender.move_held(s.engine, "7", 2, s.src, s.dst, epoch=4)
        function, ran = boundary.pop()
        ran.set_result(function())  # the engine loop, between two steps
        assert await task
        await s.network.settle()
    asyncio.run(scenario())
    first = s.bm.block_table("7")[0]
    assert first.instance_id == s.dst.engine_id
    assert (H, 7, 0) not in s.d.ledger.held  # freed after the switch
