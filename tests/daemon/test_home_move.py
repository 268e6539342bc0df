"""A home's move of its own blocks to a creditor, on the in-memory transport: the home's lender
against a creditor daemon's own handler and placer. The data travels with its commit (no
``MoveCommit`` of its own), the creditor holds the copy the home's table then names, and a move
whose answer is lost leaves nothing held there."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import torch

from infinite_llm.daemon.config import InstanceConfig
from infinite_llm.daemon.instance import InstanceDaemon
from infinite_llm.daemon.ledger import CreditorLedger
from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.daemon.peers import PeerDirectory, TransportLender
from infinite_llm.engine.block_manager import BlockManager
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.messages import KVBlocks

BLOCK_SIZE = 4
HOME, CREDITOR = 1, 2
BLOCK_SHAPE = (2, 2, BLOCK_SIZE, 1, 4)  # [layers, k/v, tokens, kv heads, head dim]


def pool_of(num_blocks: int) -> torch.Tensor:
    """``[num_blocks, *BLOCK_SHAPE]``, each block filled with its own id plus one."""
    return (torch.arange(num_blocks, dtype=torch.float32) + 1).view(-1, 1, 1, 1, 1, 1).expand(
        num_blocks, *BLOCK_SHAPE).contiguous()


def engine_with(bm: BlockManager, pool: torch.Tensor, written: dict[str, int]) -> SimpleNamespace:
    """What the lender and the creditor daemon read of an engine."""
    return SimpleNamespace(block_manager=bm, pools=[pool], home_instance_id=0, config=SimpleNamespace(
        block_size=BLOCK_SIZE), num_written_tokens=lambda: written, home_blocks_wanted=lambda: 0,
        home_blocks_promised=lambda: 0)


def creditor_daemon(tmp_path, network: InMemoryNetwork, inst_id: int, num_blocks: int) -> InstanceDaemon:
    """A creditor daemon, not started, whose handler and placer serve on ``network``."""
    bm = BlockManager(block_size=BLOCK_SIZE, pool_blocks=[num_blocks])
    daemon = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path / str(inst_id)), instance_id=inst_id,
                                           http_port=None))
    daemon.engine = engine_with(bm, torch.zeros(num_blocks, *BLOCK_SHAPE), {})
    daemon.ledger = CreditorLedger(bm.reserve_home_blocks, bm.release_home_blocks, reservation_ttl_s=5.0,
                                   first_reservation_id=40 * inst_id)
    daemon.creditor = SimpleNamespace(forget=lambda home: None)
    daemon.block_nbytes = daemon.pool[0].numel() * daemon.pool.element_size()
    daemon.transport = network.transport(PeerAddress("memory", inst_id))
    return daemon


class Setup:
    """A home with one request of 3 written blocks and a creditor daemon with 8 free blocks."""

    def __init__(self, tmp_path) -> None:
        self.network = InMemoryNetwork()
        self.creditor = creditor_daemon(tmp_path, self.network, CREDITOR, 8)
        self.creditor_free_at_start = self.creditor.engine.block_manager.num_free_blocks(0)

        self.bm = BlockManager(block_size=BLOCK_SIZE, pool_blocks=[8])
        self.bm.allocate("7", 3 * BLOCK_SIZE)
        self.home_pool = pool_of(8)
        self.engine = engine_with(self.bm, self.home_pool, {"7": 3 * BLOCK_SIZE})
        peers = PeerDirectory(HOME)
        self.peer = peers.update(CREDITOR, PeerAddress("memory", CREDITOR), 8, False, 8)
        self.lender = TransportLender(self.network.transport(PeerAddress("memory", HOME)), peers,
                                      InstanceMetrics(), timeout_s=5.0)
        self.lender.engine = self.engine

    def move(self, num_blocks: int):
        async def scenario():
            await self.creditor.transport.start(self.creditor._handle, self.creditor._place)
            move = await self.lender.send_move(self.engine, "7", num_blocks, self.peer)
            await self.network.settle()
            return move
        return asyncio.run(scenario())

    def types_to_creditor(self) -> list[str]:
        return [t for src, dst, t in self.network.messages() if dst == str(PeerAddress("memory", CREDITOR))]


def test_the_data_carries_its_commit_and_the_home_names_the_copy_held(tmp_path):
    s = Setup(tmp_path)
    home_blocks = s.bm.block_table("7")[0].block_ids[:2]
    move = s.move(2)
    assert move is not None
    assert s.types_to_creditor() == ["try_move_kv", "kv_blocks"]  # no move_commit of its own
    (key, held), = s.creditor.ledger.held.items()
    assert key == (HOME, 7, 0) and held.reservation_id == move.dst_copy_id and held.block_ids == move.dst_block_ids
    assert s.creditor.ledger.reservations == {}  # committed: it no longer expires
    assert torch.equal(s.creditor.pool[list(held.block_ids)], s.home_pool[list(home_blocks)])
    assert s.lender.switch_move(s.engine, move, s.peer)
    first = s.bm.block_table("7")[0]
    assert (first.instance_id, first.block_ids, first.copy_id) == (s.peer.engine_id, held.block_ids,
                                                                   held.reservation_id)


def test_a_move_whose_answer_is_lost_leaves_nothing_held_on_the_creditor(tmp_path):
    """The creditor stored and committed the data, but the home never heard so: the home keeps
    its table and frees the copy there by name."""
    s = Setup(tmp_path)
    serve = s.creditor._handle

    def answer_lost(message):
        reply = serve(message)
        if isinstance(message, KVBlocks):
            raise ConnectionError("the answer did not come back")
        return reply
    s.creditor._handle = answer_lost
    before = s.bm.block_table("7")
    assert s.move(2) is None
    assert s.bm.block_table("7") == before
    assert "free_segment" in s.types_to_creditor()
    assert s.creditor.ledger.held == {} and s.creditor.ledger.reservations == {}
    assert s.creditor.engine.block_manager.num_free_blocks(0) == s.creditor_free_at_start


def test_a_forwarded_segment_waits_for_its_commit(tmp_path):
    """KVBlocks without a segment to commit (a creditor forwarding a segment) only fills the
    reservation: the home commits it once it has checked its table."""
    s = Setup(tmp_path)
    reservation = s.creditor.ledger.reserve(HOME, 7, 1, 0.0)
    message = KVBlocks(1, reservation.reservation_id, (), ())
    assert s.creditor._handle(message).num_blocks == 0
    assert s.creditor.ledger.held == {} and reservation.reservation_id in s.creditor.ledger.reservations


def test_a_spill_goes_on_to_further_creditors_while_one_has_too_little_room(tmp_path):
    """The request must lend 3 blocks and no creditor has more than 2 free: the spill moves 2
    to the one with the most room, then 1 to the next, rather than stop at the first."""
    s = Setup(tmp_path)
    third = creditor_daemon(tmp_path, s.network, 3, 8)
    s.peer.num_blocks_free = 2
    other = s.lender.peers.update(3, PeerAddress("memory", 3), 1, False, 8)
    s.bm.allocate("7", 4 * BLOCK_SIZE)  # a fourth block, being written: three are lendable

    async def scenario() -> None:
        await s.creditor.transport.start(s.creditor._handle, s.creditor._place)
        await third.transport.start(third._handle, third._place)
        await s.lender.spill(s.engine, 3)
        await s.network.settle()

    asyncio.run(scenario())
    table = s.bm.block_table("7")
    assert [(seg.instance_id, len(seg.block_ids)) for seg in table] == [(s.peer.engine_id, 2), (other.engine_id, 1),
                                                                         (0, 1)]
    assert len(s.creditor.ledger.held) == 1 and len(third.ledger.held) == 1
