"""The step protocol on the in-memory transport: one StepBegin a step, the layers through a
host mailbox (the creditor's worker thread on one side, the home's polls on the other)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from infinite_llm.daemon.creditor import CreditorAttention
from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.daemon.peers import PeerDirectory, PeerPartFailed, TransportRemoteAttention
from infinite_llm.daemon.step_attention import MailboxRemoteAttention
from infinite_llm.daemon.step_server import StepServer
from infinite_llm.engine.dist_attention import AttendBatch
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.memory import InMemoryNetwork
from infinite_llm.transport.messages import (
    Ack,
    AttendRequest,
    AttendSlice,
    ErrorCode,
    ErrorReply,
    StepBegin,
    StepMailboxClose,
    StepMailboxOpen,
    StepMailboxOpened,
    StepStandDown,
)
from infinite_llm.transport.step_mailbox import STATUS_TIMED_OUT

from test_creditor import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_LAYERS, attention_over, hold, make_creditor

HOME, CREDITOR = 1, 2
TIMEOUT_S = 5.0


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def batch_of(step_id: int, engine_id: int, rows: list[tuple[str, int, int]]) -> AttendBatch:
    """An AttendBatch as the home's layout makes it, for the fields the remote side reads:
    per entry (request id, its segment's token_start, keys)."""
    n = len(rows)
    z = torch.zeros(n, dtype=torch.int32)
    return AttendBatch(step_id, engine_id, torch.zeros(n, 1, dtype=torch.int32), z, z,
                       torch.arange(n + 1, dtype=torch.int32), None, 1, max(r[2] for r in rows),
                       entry_keys=tuple((r[0], r[1]) for r in rows),
                       entry_rows=tuple((i, 1, r[2]) for i, r in enumerate(rows)))


class Pair:
    """A home and a creditor on one in-memory network; the creditor holds two requests' blocks."""

    def __init__(self, tmp_path) -> None:
        self.clock = Clock()
        self.network = InMemoryNetwork()
        self.ledger, self.pool, self.creditor = make_creditor(12)
        self.seg_a = hold(self.ledger, HOME, 7, 0, 3)
        self.seg_b = hold(self.ledger, HOME, 8, 0, 2)
        self.server = StepServer(CreditorAttention(self.ledger, self.pool, NUM_HEADS), host_id="host-a",
                                 timeout_s=TIMEOUT_S, host_dir=tmp_path, clock=self.clock)
        self.creditor_transport = self.network.transport()
        self.home_transport = self.network.transport()
        self.peers = PeerDirectory(HOME)
        self.peer = self.peers.update(CREDITOR, self.creditor_transport.address, 0, False)
        self.remote = MailboxRemoteAttention(
            TransportRemoteAttention(self.home_transport, self.peers, BLOCK_SIZE, InstanceMetrics(), TIMEOUT_S),
            self.home_transport, self.peers, num_layers=NUM_LAYERS, num_heads=NUM_HEADS, head_dim=HEAD_DIM,
            dtype=torch.float32, device=torch.device("cpu"), max_rows=4, timeout_s=TIMEOUT_S, host_id="host-a",
            clock=self.clock)
        self.attend_requests = 0

    def handle(self, message):
        if isinstance(message, AttendRequest):
            self.attend_requests += 1
            return self.creditor.attend(message)
        return self.server.handle(message)

    async def start(self) -> None:
        await self.creditor_transport.start(self.handle)
        await self.home_transport.start(lambda m: None)

    def batch(self, step_id: int) -> AttendBatch:
        # request 7: 10 of its 12 held tokens; request 8: all 8
        return batch_of(step_id, self.peer.engine_id, [("7", 0, 10), ("8", 0, 8)])

    def expected(self, layer: int, q: torch.Tensor):
        out_a, lse_a = attention_over(self.pool, self.seg_a.block_ids, 10, layer, q[:1])
        out_b, lse_b = attention_over(self.pool, self.seg_b.block_ids, 8, layer, q[1:])
        return torch.cat([out_a, out_b]), torch.cat([lse_a, lse_b])

    async def step(self, step_id: int, layers: int = NUM_LAYERS, check: bool = True) -> None:
        batch = self.batch(step_id)
        for layer in range(layers):
            q = torch.randn(2, NUM_HEADS, HEAD_DIM)
            state = await self.remote.start(batch, layer, q, HEAD_DIM ** -0.5)
            if check:
                out, lse = self.expected(layer, q)
                torch.testing.assert_close(state.out.double(), out, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(state.lse.double(), lse, atol=1e-5, rtol=1e-5)
        self.remote.end_step(step_id)
        await self.remote.finish_step(step_id)

    async def through_mailbox(self, *step_ids: int) -> None:
        """Started, step 1 by messages while the mailbox opens, then ``step_ids`` through it."""
        await self.start()
        await self.step(1)
        await self.until_open()
        for step_id in step_ids:
            await self.step(step_id)

    async def until_open(self) -> None:
        for _ in range(1000):
            if self.remote.has_mailbox(CREDITOR):
                return
            await asyncio.sleep(0.001)
        raise AssertionError("the mailbox did not open")

    async def close(self) -> None:
        await self.remote.close()
        self.server.close_all()
        await self.home_transport.close()
        await self.creditor_transport.close()


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_a_step_goes_by_messages_while_the_mailbox_opens_then_through_it(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.start()
        await pair.step(1)  # no mailbox yet: one AttendRequest a layer, the mailbox opening meanwhile
        assert pair.attend_requests == NUM_LAYERS
        await pair.until_open()
        assert pair.server.num_mailboxes == 1
        for step_id in (2, 3, 4):
            await pair.step(step_id)
        # Three steps, one StepBegin each and no AttendRequest: every layer went through the mailbox.
        assert pair.attend_requests == NUM_LAYERS
        assert pair.server.steps_begun == 3 and pair.remote.steps_on_mailboxes == 3
        types = [e.message_type for e in pair.network.trace if e.dst == pair.creditor_transport.address]
        assert types.count(StepBegin.TYPE) == 3 and types.count(StepMailboxOpen.TYPE) == 1
        # The plan is the one kept from step to step.
        assert pair.server.planner.plans_made == 1
        await pair.close()
        assert not list(tmp_path.iterdir())  # the mailbox's file went with it
    run(scenario())


def test_a_step_whose_queries_stop_coming_is_given_up_and_its_mailbox_freed(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.start()
        await pair.step(1)
        await pair.until_open()
        # The home sends the step and its first layer, then goes quiet (as a home that died).
        batch = pair.batch(2)
        q = torch.randn(2, NUM_HEADS, HEAD_DIM)
        await pair.remote.start(batch, 0, q, HEAD_DIM ** -0.5)
        assert pair.server.check_deadlines() == []
        pair.clock.now_s += TIMEOUT_S + 0.1
        assert pair.server.check_deadlines() == [(HOME, 2)]
        assert pair.server.timeouts == 1 and pair.server.num_mailboxes == 0
        # The home, alive after all, learns it at the step's end and merges nothing of it.
        opened = pair.remote._opened[CREDITOR]
        for _ in range(1000):
            if int(opened.mailbox.status[0]) == STATUS_TIMED_OUT:
                break
            await asyncio.sleep(0.001)
        with pytest.raises(PeerPartFailed, match="gave the step up"):
            await pair.remote.finish_step(2)
        assert not pair.remote.has_mailbox(CREDITOR)
        await asyncio.sleep(0.01)
        assert not list(tmp_path.iterdir())
        await pair.close()
    run(scenario())


def test_a_step_over_segments_not_held_is_refused_and_the_home_fails_it_at_once(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.start()
        await pair.step(1)
        await pair.until_open()
        bad = batch_of(2, pair.peer.engine_id, [("9", 0, 4)])  # request 9 has nothing here
        with pytest.raises(PeerPartFailed, match="refused the step"):
            await pair.remote.start(bad, 0, torch.randn(1, NUM_HEADS, HEAD_DIM), 1.0)
        assert pair.remote.step_failed(2)
        with pytest.raises(PeerPartFailed):
            await pair.remote.finish_step(2)
        assert not pair.remote.has_mailbox(CREDITOR)
        await pair.close()
    run(scenario())


def test_bad_step_messages_get_error_replies(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.start()
        to = pair.creditor_transport.address
        slices = (AttendSlice(7, 0, 1, 0, 4),)

        async def ask(message):
            try:
                return await pair.home_transport.request(to, message, timeout_s=TIMEOUT_S)
            except RemoteError as e:  # the transport raises an ErrorReply as this
                return ErrorReply(e.code, e.detail)

        reply = await ask(StepBegin(HOME, CREDITOR, 99, 1, NUM_LAYERS, slices, 1))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_REFUSED
        reply = await ask(StepMailboxOpen(HOME, CREDITOR, NUM_LAYERS, 4, NUM_HEADS, HEAD_DIM, "float32", "host-b"))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_MAILBOX_UNAVAILABLE
        assert "another host" in reply.detail
        reply = await ask(StepMailboxOpen(HOME, CREDITOR, NUM_LAYERS + 1, 4, NUM_HEADS, HEAD_DIM, "float32", "host-a"))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_MAILBOX_UNAVAILABLE
        reply = await ask(StepMailboxOpen(HOME, CREDITOR, NUM_LAYERS, 4, NUM_HEADS, HEAD_DIM, "float32", "host-a"))
        assert isinstance(reply, StepMailboxOpened) and reply.host_path
        # A step of more rows than the mailbox has, and one of another home, are refused.
        many = tuple(AttendSlice(7, i, 1, 0, 4) for i in range(5))
        reply = await ask(StepBegin(HOME, CREDITOR, reply.mailbox_id, 1, NUM_LAYERS, many, 5))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_REFUSED
        reply2 = await ask(StepBegin(HOME + 5, CREDITOR, 1, 1, NUM_LAYERS, slices, 1))
        assert isinstance(reply2, ErrorReply) and reply2.code == ErrorCode.STEP_REFUSED
        await pair.home_transport.send(to, StepMailboxClose(HOME, 1))
        for _ in range(100):
            if pair.server.num_mailboxes == 0:
                break
            await asyncio.sleep(0.001)
        assert pair.server.num_mailboxes == 0
        await pair.close()
    run(scenario())


def test_a_link_asked_of_a_creditor_on_the_host_is_refused_and_the_home_attends_by_messages(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.start()
        try:
            reply = await pair.home_transport.request(
                pair.creditor_transport.address,
                StepMailboxOpen(HOME, CREDITOR, NUM_LAYERS, 4, NUM_HEADS, HEAD_DIM, "float32", "host-b",
                                nccl_id="0" * 256), timeout_s=TIMEOUT_S)
        except RemoteError as e:
            reply = ErrorReply(e.code, e.detail)
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_MAILBOX_UNAVAILABLE
        assert "no NCCL links here" in reply.detail
        assert pair.server.num_mailboxes == 0
        # A home on the host never asks for a link: a creditor of another host refuses the
        # mailbox, and its steps go by messages, exactly.
        assert pair.remote.nccl_links == "never"
        pair.remote.host_id = "host-b"
        await pair.step(1)
        for _ in range(200):
            if not pair.remote._opening:
                break
            await asyncio.sleep(0.001)
        await pair.step(2)
        assert not pair.remote.has_mailbox(CREDITOR) and pair.attend_requests == 2 * NUM_LAYERS
        assert pair.remote.links_made == 0 and pair.remote.steps_on_links == 0
        await pair.close()
    run(scenario())


@pytest.mark.parametrize("fields", [dict(nccl_id="xyz"), dict(nccl_id="0" * 255)])
def test_an_open_request_with_a_malformed_nccl_id_is_refused_when_made(fields) -> None:
    with pytest.raises(ValueError, match="nccl_id"):
        StepMailboxOpen(1, 2, 2, 4, 4, 8, "float32", "h", **fields)


def test_a_step_begin_of_fewer_wire_rows_than_rows_is_refused_when_made() -> None:
    slices = (AttendSlice(7, 0, 2, 0, 4),)
    with pytest.raises(ValueError, match="wire_rows"):
        StepBegin(HOME, CREDITOR, 1, 1, NUM_LAYERS, slices, 2, wire_rows=1)
    assert StepBegin(HOME, CREDITOR, 1, 1, NUM_LAYERS, slices, 2, wire_rows=4).wire_rows == 4


def test_an_opened_answer_is_one_of_an_offer_a_path_and_a_link() -> None:
    assert StepMailboxOpened(3, 64, (), "", nccl=True).nccl
    with pytest.raises(ValueError):
        StepMailboxOpened(3, 64, (), "/dev/shm/x", nccl=True)
    with pytest.raises(ValueError):
        StepMailboxOpened(3, 64, (), "")


@pytest.mark.parametrize("field, value", [("num_layers", 0), ("max_rows", 0), ("home_inst_id", -1)])
def test_an_open_request_out_of_range_is_refused_when_made(field, value) -> None:
    fields = dict(home_inst_id=1, creditor_inst_id=2, num_layers=2, max_rows=4, num_heads=4, head_dim=8,
                  dtype="float32", host_id="h")
    fields[field] = value
    with pytest.raises(ValueError):
        StepMailboxOpen(**fields)


# --- steps queued ahead ------------------------------------------------------------------------


async def _wait_for(condition, what: str) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"not reached: {what}")


def test_a_step_like_the_last_finds_its_layers_queued_ahead(tmp_path) -> None:
    """Each StepBegin queues the next step of its slices too; the home's next step of the same
    slices writes its queries at once and the StepBegin only assigns that step."""
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2, 3, 4, 5)
        server = pair.server
        assert server.steps_begun == 4 and server.steps_assigned_ahead == 3
        assert pair.remote.steps_answer_first == 0 and server.steps_let_go == 0
        served = next(iter(server._served.values()))
        assert served.ahead is not None and served.ahead.step_id == -1  # step 6's, queued
        assert pair.server.planner.plans_made == 1
        await pair.close()
    run(scenario())


def test_a_step_of_other_slices_waits_for_its_answer_and_lets_the_queued_step_go(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2)
        # Step 3 attends for request 7 alone: its queries wait for the StepBegin's answer, and
        # the step queued ahead for both requests is let go unrun.
        batch = batch_of(3, pair.peer.engine_id, [("7", 0, 10)])
        for layer in range(NUM_LAYERS):
            q = torch.randn(1, NUM_HEADS, HEAD_DIM)
            state = await pair.remote.start(batch, layer, q, HEAD_DIM ** -0.5)
            out, lse = attention_over(pair.pool, pair.seg_a.block_ids, 10, layer, q)
            torch.testing.assert_close(state.out.double(), out, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(state.lse.double(), lse, atol=1e-5, rtol=1e-5)
        pair.remote.end_step(3)
        await pair.remote.finish_step(3)
        assert pair.remote.steps_answer_first == 1 and pair.server.steps_let_go == 1
        # Back to both requests: another change, answered first again; then steps like it.
        for step_id in (4, 5):
            await pair.step(step_id)
        assert pair.remote.steps_answer_first == 2 and pair.server.steps_let_go == 2
        assert pair.server.steps_assigned_ahead == 1  # step 5's
        await pair.close()
    run(scenario())


def test_a_step_without_the_creditor_and_an_idle_home_stand_it_down(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2)
        served = next(iter(pair.server._served.values()))
        assert served.ahead is not None
        # Step 3 attends over nothing held there: the creditor is told to stand down.
        pair.remote.end_step(3)
        await pair.remote.finish_step(3)
        await _wait_for(lambda: served.ahead is None, "the stand-down")
        assert pair.remote.stand_downs == 1 and pair.server.steps_let_go == 1
        assert pair.server.num_mailboxes == 1  # the mailbox stays open
        # The stand-down was answered: nothing is queued ahead there, so the next step's
        # queries need not wait for its StepBegin's answer; it serves exactly.
        await _wait_for(lambda: pair.remote._opened[CREDITOR].standing_down.done(), "the stand-down's answer")
        await pair.step(4)
        assert pair.remote.steps_answer_first == 0
        # Idle: every creditor with a step queued ahead stands down.
        pair.remote.stand_down_all(4)
        await _wait_for(lambda: served.ahead is None, "the idle stand-down")
        pair.clock.now_s += TIMEOUT_S + 1  # nothing queued: the watchdog has nothing to give up
        assert pair.server.check_deadlines() == [] and pair.server.num_mailboxes == 1
        await pair.close()
    run(scenario())


def test_a_stand_down_that_comes_after_a_later_step_began_is_ignored(tmp_path) -> None:
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(5)
        served = next(iter(pair.server._served.values()))
        reply = pair.server.handle(StepStandDown(HOME, served.mailbox_id, 4))
        assert isinstance(reply, Ack) and served.ahead is not None
        reply = pair.server.handle(StepStandDown(HOME, served.mailbox_id + 7, 5))
        assert isinstance(reply, ErrorReply) and reply.code == ErrorCode.STEP_REFUSED
        await pair.close()
    run(scenario())


def test_a_quiet_home_s_queued_step_is_given_up_by_the_watchdog(tmp_path) -> None:
    """A home that stops without standing down: its step queued ahead waits no longer than
    the timeout, and the mailbox is freed once the worker has let it go."""
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2)
        assert pair.server.check_deadlines() == []
        pair.clock.now_s += TIMEOUT_S + 0.1
        assert pair.server.check_deadlines() == []  # no step of the home's was given up
        assert pair.server.num_mailboxes == 0
        await _wait_for(lambda: not pair.server._retired or pair.server.check_deadlines() == [] and
                        not pair.server._retired, "the mailbox freed")
        # The home's next step finds the mailbox gone: refused, failed, the mailbox dropped.
        batch = pair.batch(3)
        with pytest.raises(PeerPartFailed):
            for layer in range(NUM_LAYERS):
                await pair.remote.start(batch, layer, torch.randn(2, NUM_HEADS, HEAD_DIM), 1.0)
            await pair.remote.finish_step(3)
        pair.remote.abandon_step(3)
        assert not pair.remote.has_mailbox(CREDITOR)
        await pair.close()
    run(scenario())


def test_a_step_queued_ahead_over_segments_that_changed_is_refused(tmp_path) -> None:
    """Its home may run it before its StepBegin arrives: the creditor refuses it (its tables
    are stale), and the home, which accepts no step before the answer, fails it."""
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2)
        hold(pair.ledger, HOME, 9, 0, 1)  # a segment committed since: the queued step still reads right
        await pair.step(3)
        pair.ledger.free_segment(HOME, 9, 0)  # one freed since: its plan's walk is not current
        with pytest.raises(PeerPartFailed, match="changed"):
            await pair.step(4, check=False)
        pair.remote.abandon_step(4)
        assert not pair.remote.has_mailbox(CREDITOR) and pair.server.num_mailboxes == 0
        # The step again, by messages while a new mailbox opens: exact.
        await pair.step(5)
        await pair.close()
    run(scenario())


def test_a_stand_down_that_is_refused_drops_the_mailbox(tmp_path) -> None:
    """Whether a step is still queued there is then unknown: the home does not use it again."""
    async def scenario():
        pair = Pair(tmp_path)
        await pair.through_mailbox(2)
        served = next(iter(pair.server._served.values()))
        pair.server._retire(served, "closed under the home's feet")
        pair.remote.stand_down_all(2)
        await _wait_for(lambda: not pair.remote.has_mailbox(CREDITOR), "the mailbox dropped")
        await pair.step(3)  # by messages, exact
        await pair.close()
    run(scenario())
