"""A home's move of its own blocks to a creditor, on the in-memory transport: the home's lender
against a creditor daemon's own handler and placer. The data travels with its commit (no
``MoveCommit`` of its own), the creditor holds the copy the home's table then names, and a move
whose answer is lost leaves nothing held there."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from types import SimpleNamespace

import pytest
import torch

from infinite_llm.daemon.config import InstanceConfig
from infinite_llm.daemon.instance import InstanceDaemon
from infinite_llm.daemon.ledger import CreditorLedger, LedgerError
from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.daemon.peers import PeerDirectory, TransportLender
from infinite_llm.engine.block_manager import BlockManager
from infinite_llm.transport.errors import PlacementRefused
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.messages import BlockRun, KVBlocks, MoveKV, TryMoveKV

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


def creditor_daemon(tmp_path, network: InMemoryNetwork, inst_id: int, num_blocks: int,
                    device: str = "cpu") -> InstanceDaemon:
    """A creditor daemon, not started, whose handler and placer serve on ``network``."""
    bm = BlockManager(block_size=BLOCK_SIZE, pool_blocks=[num_blocks])
    daemon = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path / str(inst_id)), instance_id=inst_id,
                                           http_port=None))
    daemon.engine = engine_with(bm, torch.zeros(num_blocks, *BLOCK_SHAPE, device=device), {})
    daemon.ledger = CreditorLedger(bm.reserve_home_blocks, bm.release_home_blocks, reservation_ttl_s=5.0,
                                   first_reservation_id=40 * inst_id)
    daemon.creditor = SimpleNamespace(forget=lambda home: None)
    daemon.block_nbytes = daemon.pool[0].numel() * daemon.pool.element_size()
    daemon.transport = network.transport(PeerAddress("memory", inst_id))
    return daemon


class Setup:
    """A home with one request of 3 written blocks and a creditor daemon with 8 free blocks."""

    def __init__(self, tmp_path, device: str = "cpu") -> None:
        self.network = InMemoryNetwork()
        self.creditor = creditor_daemon(tmp_path, self.network, CREDITOR, 8, device)
        self.creditor_free_at_start = self.creditor.engine.block_manager.num_free_blocks(0)

        self.bm = BlockManager(block_size=BLOCK_SIZE, pool_blocks=[8])
        self.bm.allocate("7", 3 * BLOCK_SIZE)
        self.home_pool = pool_of(8).to(device)
        self.engine = engine_with(self.bm, self.home_pool, {"7": 3 * BLOCK_SIZE})
        peers = PeerDirectory(HOME)
        self.peer = peers.update(CREDITOR, PeerAddress("memory", CREDITOR), 8, False, 8)
        self.lender = TransportLender(self.network.transport(PeerAddress("memory", HOME)), peers,
                                      InstanceMetrics(), timeout_s=5.0)
        self.lender.engine = self.engine

    def move(self, num_blocks: int, before=None):
        """Move the request's first ``num_blocks`` blocks; ``before()`` runs on the event loop
        first, and what it returns is returned beside the move."""
        async def scenario():
            await self.creditor.transport.start(self.creditor._handle, self.creditor._place)
            ran_before = before() if before is not None else None
            move = await self.lender.send_move(self.engine, "7", num_blocks, self.peer)
            await self.network.settle()
            return move if before is None else (move, ran_before)
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


@pytest.mark.gpu
def test_on_a_gpu_a_move_waits_for_the_engines_queued_writes_with_the_event_loop_free(tmp_path):
    """The blocks' last writes are still queued on the engine's stream, behind a long kernel
    chain, when the move starts: the creditor gets what they write, and while the move waits
    for them the event loop goes on (a ticker keeps ticking), instead of blocking on the stream."""
    s = Setup(tmp_path, device="cuda")
    home_blocks = list(s.bm.block_table("7")[0].block_ids[:2])
    written = torch.randn(2, *BLOCK_SHAPE, device="cuda")
    first = home_blocks[0]
    assert home_blocks == [first, first + 1]  # a slice: an index op may wait for the device
    s.lender.prepare(s.home_pool)  # as the daemon does at start (a new stream waits for the device)
    busy = torch.randn(4096, 4096, device="cuda")
    for _ in range(60):  # once untimed: first calls set libraries and memory up, synchronously
        busy = torch.tanh(busy @ busy)
    torch.cuda.synchronize()

    def queue_work_and_start_ticker():
        nonlocal busy
        for _ in range(60):  # a few ms each on any GPU: the move waits for all of it
            busy = torch.tanh(busy @ busy)
        s.home_pool[first:first + 2].copy_(written)  # the blocks' last writes, queued behind
        queued = torch.cuda.Event()
        queued.record()
        assert not queued.query(), "the queued work ran out before the move started"
        started = time.perf_counter()
        ticks = []

        async def tick():
            while True:
                ticks.append(time.perf_counter())
                await asyncio.sleep(0.001)
        return asyncio.get_running_loop().create_task(tick()), ticks, started

    move, (ticker, ticks, started) = s.move(2, before=queue_work_and_start_ticker)
    ticker.cancel()
    assert move is not None
    (key, held), = s.creditor.ledger.held.items()
    assert torch.equal(s.creditor.pool[list(held.block_ids)], written)
    waited_s = time.perf_counter() - started
    assert waited_s > 0.02, "the queued work was too short to show the loop turning"
    assert len(ticks) >= 5, f"the event loop turned {len(ticks)} times during a {waited_s:.3f} s wait"


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
    (block,) = reservation.block_ids
    message = KVBlocks(1, reservation.reservation_id, (BlockRun(block, 1),), (s.creditor.pool[block:block + 1],),
                       home_inst_id=HOME, req_id=7)
    s.creditor._place(message)
    assert s.creditor._handle(message).num_blocks == 1
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


async def turns_until(condition, max_turns: int = 10_000) -> None:
    """Let the event loop turn until ``condition()`` holds (the in-memory network needs no time)."""
    for _ in range(max_turns):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"not so after {max_turns} turns of the event loop")


def test_a_free_that_overtakes_the_blocks_leaves_nothing_held(tmp_path):
    """The home stops waiting for its blocks to land (they land in the background, for up to the
    frame timeout) and frees the copy by name before they have: the creditor gives the
    reservation up, never commits it, and frees its blocks once they have landed."""
    s = Setup(tmp_path)
    serve = s.creditor._handle
    landing = asyncio.Event()
    order = []

    def blocks_land_late(message):
        if isinstance(message, KVBlocks):
            async def once_landed():
                await landing.wait()
                order.append("kv_blocks")
                return serve(message)
            return once_landed()
        order.append(message.TYPE)
        return serve(message)
    s.creditor._handle = blocks_land_late

    async def scenario():
        await s.creditor.transport.start(s.creditor._handle, s.creditor._place)
        move = asyncio.ensure_future(s.lender.send_move(s.engine, "7", 2, s.peer))
        await turns_until(lambda: any(r.receiving for r in s.creditor.ledger.reservations.values()))
        s.network.clock.tick(6.0)  # past the home's wait for the data's answer
        assert await move is None
        await turns_until(lambda: "free_segment" in order)
        (reservation,) = s.creditor.ledger.reservations.values()
        assert reservation.cancelled  # given up, its blocks still being written
        assert s.creditor.engine.block_manager.num_free_blocks(0) == s.creditor_free_at_start - 2
        landing.set()
        await s.network.settle()

    asyncio.run(scenario())
    assert order == ["try_move_kv", "free_segment", "kv_blocks"]
    assert s.creditor.ledger.held == {} and s.creditor.ledger.reservations == {}
    assert s.creditor.engine.block_manager.num_free_blocks(0) == s.creditor_free_at_start
    assert [seg.instance_id for seg in s.bm.block_table("7")] == [0]


def test_blocks_still_landing_are_not_given_to_another_home_when_theirs_is_forgotten(tmp_path):
    """A home restarts (or its request ends) while a segment forwarded for it lands here: the
    reservation is given up, but its blocks stay out of the free list until the data has landed."""
    network = InMemoryNetwork()
    creditor = creditor_daemon(tmp_path, network, CREDITOR, 4)
    reservation = creditor.ledger.reserve(HOME, 7, 2, 0.0)
    blocks = KVBlocks(9, reservation.reservation_id, (BlockRun(reservation.block_ids[0], 2),), (pool_of(2),),
                      home_inst_id=HOME, req_id=7)
    views = creditor._place(blocks)  # UCX now writes into these blocks
    assert creditor.ledger.forget_home(HOME) == 0
    assert creditor.ledger.reserve(3, 5, 3, 0.0) is None  # two free blocks, not four
    views[0].copy_(pool_of(2))  # the rest of the frame lands
    try:
        creditor._handle(blocks)
    except LedgerError as exc:
        assert "given up" in str(exc)
    else:
        raise AssertionError("blocks for a given-up reservation were acknowledged")
    assert creditor.ledger.reservations == {} and creditor.ledger.held == {}
    assert creditor.engine.block_manager.num_free_blocks(0) == 4


def test_blocks_must_fill_their_own_requests_reservation_once(tmp_path):
    network = InMemoryNetwork()
    creditor = creditor_daemon(tmp_path, network, CREDITOR, 8)
    ours = creditor.ledger.reserve(HOME, 7, 2, 0.0)
    first = ours.block_ids[0]

    def blocks(runs, home=HOME, req=7):
        return KVBlocks(1, ours.reservation_id, runs, tuple(pool_of(r.num_blocks) for r in runs),
                        commit_segment_id=0, home_inst_id=home, req_id=req)

    for bad, why in ((blocks((BlockRun(first, 2),), home=3, req=1), "not request 1 of instance 3"),
                     (blocks((BlockRun(first, 2),), req=8), "not request 8 of instance 1"),
                     (blocks((BlockRun(first, 1),)), "fill 1 of the 2 blocks"),
                     (blocks((BlockRun(first, 1), BlockRun(first, 1))), "written twice"),
                     (blocks((BlockRun(first + 1, 2),)), "not in reservation")):
        try:
            creditor._place(bad)
        except PlacementRefused as exc:
            assert why in str(exc), (why, exc)
        else:
            raise AssertionError(f"placed: {bad.runs}")
        with pytest.raises(ValueError, match="without being placed"):
            creditor._handle(bad)
    assert creditor.ledger.held == {} and ours.reservation_id in creditor.ledger.reservations
    good = blocks((BlockRun(first, 2),))
    creditor._place(good)
    with pytest.raises(PlacementRefused, match="landing already"):
        creditor._place(good)
    assert creditor._handle(good).num_blocks == 2
    assert list(creditor.ledger.held) == [(HOME, 7, 0)]


def test_blocks_sent_again_before_their_commit_are_refused(tmp_path):
    """A reservation whose data landed without its commit (a forward: ``MoveCommit`` follows)
    takes no data again: each copy would put off its expiry, and the creditor would keep the
    blocks, never committed, for as long as copies came."""
    network = InMemoryNetwork()
    creditor = creditor_daemon(tmp_path, network, CREDITOR, 8)
    ours = creditor.ledger.reserve(HOME, 7, 2, time.monotonic())
    blocks = KVBlocks(1, ours.reservation_id, (BlockRun(ours.block_ids[0], 2),), (pool_of(2),),
                      commit_segment_id=-1, home_inst_id=HOME, req_id=7)
    creditor._place(blocks)
    assert creditor._handle(blocks).num_blocks == 2  # landed; the commit has not come
    expires_at = creditor.ledger.reservations[ours.reservation_id].expires_at
    with pytest.raises(PlacementRefused, match="landed already"):
        creditor._place(blocks)
    assert creditor.ledger.reservations[ours.reservation_id].expires_at == expires_at
    assert creditor.ledger.release_expired(expires_at) and creditor.ledger.reservations == {}
    assert creditor.engine.block_manager.num_free_blocks(0) == 8


def test_an_ordered_move_stops_at_the_next_piece_once_a_newer_leader_spoke(tmp_path, monkeypatch):
    """A gManager's move goes piece by piece; after the first piece the home hears of a newer
    leader (epoch 6): no further piece goes out under the old order (epoch 5)."""
    import infinite_llm.daemon.peers as peers_module

    network = InMemoryNetwork()
    creditor = creditor_daemon(tmp_path, network, CREDITOR, 8)
    bm = BlockManager(block_size=BLOCK_SIZE, pool_blocks=[8])
    bm.allocate("7", 4 * BLOCK_SIZE)
    engine = engine_with(bm, pool_of(8), {"7": 4 * BLOCK_SIZE})
    monkeypatch.setattr(peers_module, "MOVE_PIECE_BYTES", engine.pools[0][0].numel() * 4)  # a block a piece
    home = InstanceDaemon(InstanceConfig(state_dir=str(tmp_path / "home"), instance_id=HOME, http_port=None))
    home.engine = engine
    home.peers.update(CREDITOR, PeerAddress("memory", CREDITOR), 8, False, 8)
    home.lender = TransportLender(network.transport(PeerAddress("memory", HOME)), home.peers, home.metrics,
                                  timeout_s=5.0)
    home.lender.engine = engine
    tried_epochs = []
    serve = creditor._handle

    def noting_epochs(message):
        if isinstance(message, TryMoveKV):
            tried_epochs.append(message.epoch)
        return serve(message)

    async def scenario() -> bool:
        await creditor.transport.start(noting_epochs, creditor._place)
        for fence in (home.fence, creditor.fence):
            fence.admit(5)
        done = asyncio.get_running_loop().create_future()
        order = MoveKV(epoch=5, move_id=1, home_inst_id=HOME, req_id=7, src_inst_id=HOME, dst_inst_id=CREDITOR,
                       num_blocks=4)
        task = asyncio.ensure_future(home._send_ordered_move(order, done))
        for _ in range(100):  # step boundaries
            if task.done():
                break
            await network.settle()
            if home._at_step_boundary:
                await home._carry_out_ordered_moves()
                home.fence.admit(6)  # a heartbeat reply from a new leader
        assert task.done()
        return await done

    assert asyncio.run(scenario()) is True  # one piece moved
    assert tried_epochs == [5]
    assert [(seg.instance_id, len(seg.block_ids)) for seg in bm.block_table("7")] == [(1, 1), (0, 3)]
    assert home.metrics.stale_epoch_commands._value.get() == 1


@pytest.mark.parametrize("ends", ["before the ask starts", "while the ask is in flight"])
def test_a_hold_granted_to_a_request_that_ended_is_given_back(tmp_path, ends):
    """A waiting request asks the peers to keep blocks for it (in the background) and ends (its
    client left) before that ask is answered: what the creditor grants goes back at once, rather
    than stay kept from other homes until the hold's time runs out, and the home keeps no table
    of holds for the request."""
    s = Setup(tmp_path)
    holds_asked: list[int] = []
    serve = s.creditor._handle

    def handle(message):
        if message.TYPE == "hold_kv":
            holds_asked.append(message.num_blocks)
        return serve(message)

    async def scenario() -> None:
        await s.creditor.transport.start(handle, s.creditor._place)
        assert s.lender.blocks_kept_elsewhere("9", 4) == 0  # the ask starts in the background
        if ends == "while the ask is in flight":
            await turns_until(lambda: holds_asked)
        s.lender.forget("9")
        await turns_until(lambda: not s.lender._asking)
        await s.network.settle()

    asyncio.run(scenario())
    assert s.creditor.ledger.holds == {}
    assert s.lender._holds == {} and s.lender._ended_while_asking == set()
    assert holds_asked in ([], [4, 0])


def test_holds_a_request_still_counts_on_are_renewed_before_the_peer_lets_them_go(tmp_path):
    """A peer keeps a hold for ``kv_hold_s``; a request that waits longer (or runs without
    spilling) would count on blocks given to others since. The home renews its holds every
    ``hold_renew_s``: the peer's time starts over, and where the peer keeps fewer (it let the
    hold go and gave the blocks away, a spill used some, it drains), the home counts what it
    says. A renewal makes no hold: one that crosses the request's end leaves none behind."""
    s = Setup(tmp_path)
    asked: list[tuple[int, bool]] = []
    serve = s.creditor._handle
    ledger = s.creditor.ledger
    key = (HOME, 9)
    before_renewal = []  # what happens at the peer just before it takes a renewal

    def handle(message):
        if message.TYPE == "hold_kv":
            asked.append((message.num_blocks, message.renew))
            if message.renew and before_renewal:
                before_renewal.pop()()
        return serve(message)

    async def hold_four() -> None:
        assert s.lender.blocks_kept_elsewhere("9", 4) < 4  # asked in the background
        await turns_until(lambda: not s.lender._asking)
        assert s.lender.blocks_kept_elsewhere("9", 4) == 4 and ledger.hold_of(HOME, 9) == 4

    async def renew_at(now: float) -> None:
        s.lender.renew_holds(now)
        await turns_until(lambda: not s.lender._renewing)
        await s.network.settle()

    def later(periods: float) -> float:
        return s.lender._holds_set_at["9"][CREDITOR] + periods * s.lender.hold_renew_s

    async def scenario() -> None:
        await s.creditor.transport.start(handle, s.creditor._place)
        await hold_four()
        await renew_at(later(0.5))  # not yet
        assert asked == [(4, False)]
        ledger.holds[key] = dataclasses.replace(ledger.holds[key], expires_at=0.0)  # nearly out
        await renew_at(later(1))
        assert asked[-1] == (0, True) and ledger.holds[key].expires_at > time.monotonic()  # time starts over
        assert s.lender.held_on("9", CREDITOR) == ledger.hold_of(HOME, 9) == 4

        # A spill's reservation uses three blocks of the hold just before the peer takes a
        # renewal: the renewal keeps the one left, and the home counts one.
        def spill_uses_three() -> None:
            ledger.reserve(HOME, 9, 3, time.monotonic())
            assert s.lender._used_hold("9", CREDITOR, 3) == 3
        before_renewal.append(spill_uses_three)
        await renew_at(later(1))
        assert s.lender.held_on("9", CREDITOR) == ledger.hold_of(HOME, 9) == 1

        # The peer let the hold go and gave the blocks to another home: the renewal makes none.
        ledger.release_expired(float("inf"))
        ledger.reserve(3, 1, 7, time.monotonic())
        await renew_at(later(1))
        assert s.lender.held_on("9", CREDITOR) == ledger.hold_of(HOME, 9) == 0

    asyncio.run(scenario())
    assert asked == [(4, False), (0, True), (0, True), (0, True)]


def test_a_renewal_that_crosses_the_requests_end_or_a_drain_leaves_no_hold(tmp_path):
    s = Setup(tmp_path)
    ledger = s.creditor.ledger

    async def scenario() -> None:
        await s.creditor.transport.start(s.creditor._handle, s.creditor._place)
        for end in ("forget", "drain"):
            assert s.lender.blocks_kept_elsewhere("9", 4) == 0
            await turns_until(lambda: not s.lender._asking)
            assert ledger.hold_of(HOME, 9) == 4
            s.lender.renew_holds(time.monotonic() + s.lender.hold_renew_s)
            assert s.lender._renewing == {("9", CREDITOR)}
            if end == "forget":
                s.lender.forget("9")  # its release goes out after the renewal
            else:
                s.creditor.draining = True  # a draining peer keeps nothing for anyone
            await turns_until(lambda: not s.lender._renewing)
            await s.network.settle()
            assert ledger.holds == {}
            s.creditor.draining = False
        assert s.lender.held_on("9", CREDITOR) == 0  # what the draining peer said
        s.lender.forget("9")
        await s.network.settle()

    asyncio.run(scenario())
    assert s.lender._holds == {} and s.lender._holds_set_at == {} and ledger.holds == {}


def test_a_spill_passes_over_a_request_whose_move_is_in_flight(tmp_path):
    """While a move of the request is between its reservation and its switch (an ordered move in
    the background), a spill of the steps short of blocks does not try the request on every
    creditor: nothing is sent, and no failed move is counted for moves never attempted."""
    s = Setup(tmp_path)
    third = creditor_daemon(tmp_path, s.network, 3, 8)
    s.lender.peers.update(3, PeerAddress("memory", 3), 8, False, 8)
    failed = s.lender.metrics.moves.labels(result="failed")

    async def scenario() -> None:
        await s.creditor.transport.start(s.creditor._handle, s.creditor._place)
        await third.transport.start(third._handle, third._place)
        s.lender._moving.add("7")
        for _step in range(3):
            await s.lender.spill(s.engine, 2)
        await s.network.settle()

    asyncio.run(scenario())
    assert s.network.messages() == []
    assert failed._value.get() == 0


def test_a_restarted_homes_old_blocks_go_at_its_first_request_and_its_new_ones_stay(tmp_path):
    """A home restarts and its new run moves blocks to the creditor before the creditor's
    membership tick has seen the restart. The new run's request frees what the old run had there
    (that run is gone, and the new one knows nothing of it); the tick that then sees the new
    record frees nothing of the new run's, which the home's table names."""
    from infinite_llm.daemon.membership import Member

    s = Setup(tmp_path)
    s.bm.allocate("7", 4 * BLOCK_SIZE)

    def record(pid: int, run_id: int) -> Member:
        return Member(inst_id=HOME, pid=pid, peer_host="memory", peer_port=HOME, http_port=0, socket_path="",
                      num_blocks_total=8, num_blocks_free=0, draining=False, updated_at=0.0, run_id=run_id)

    s.creditor._forget_restarted_homes({HOME: record(100, 111)})  # the creditor knows the old run

    async def scenario() -> None:
        await s.creditor.transport.start(s.creditor._handle, s.creditor._place)
        s.lender.run_id = 111
        old = await s.lender.send_move(s.engine, "7", 1, s.peer)
        assert old is not None and s.lender.switch_move(s.engine, old, s.peer)
        s.lender.run_id = 222  # the home restarted (the same engine stands in for the new run's)
        new = await s.lender.send_move(s.engine, "7", 1, s.peer)
        assert new is not None and s.lender.switch_move(s.engine, new, s.peer)
        await s.network.settle()

    asyncio.run(scenario())
    assert list(s.creditor.ledger.held) == [(HOME, 7, 1)]  # the old run's segment 0 went
    s.creditor._forget_restarted_homes({HOME: record(200, 222)})  # the tick sees the restart
    assert list(s.creditor.ledger.held) == [(HOME, 7, 1)]
    held_blocks = s.creditor.ledger.held[(HOME, 7, 1)].block_ids
    assert s.creditor_free_at_start - s.creditor.engine.block_manager.num_free_blocks(0) == len(held_blocks)
    # A restart with nothing of the new run here yet: the tick frees what the old run left.
    s.creditor._forget_restarted_homes({HOME: record(300, 333)})
    assert s.creditor.ledger.held == {}
