"""The in-memory transport: same interface as UCX, deterministic under a fake clock."""

from __future__ import annotations

import asyncio

import pytest
import torch

from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import (
    PeerUnreachable,
    PlacementRefused,
    RemoteError,
    RequestTimeout,
)
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.memory import FakeClock, InMemoryNetwork

A = PeerAddress("memory", 1)
B = PeerAddress("memory", 2)
C = PeerAddress("memory", 3)


def run(coroutine):
    async def bounded():
        async with asyncio.timeout(10):  # real seconds: only a bug takes this long
            return await coroutine
    return asyncio.run(bounded())


async def echo(message: m.Message) -> m.Message | None:
    if isinstance(message, m.Echo):
        return m.EchoReply(message.payload)
    return None


def test_request_reply_and_trace():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        await a.start(echo)
        await b.start(echo)
        reply = await a.request(B, m.Echo(torch.arange(3)))
        assert torch.equal(reply.payload, torch.arange(3))
        assert await a.request(B, m.Drain(epoch=1, drain_id=1, inst_id=2)) == m.Ack()
        assert net.messages() == [
            ("memory:1", "memory:2", "echo"), ("memory:2", "memory:1", "echo_reply"),
            ("memory:1", "memory:2", "drain"), ("memory:2", "memory:1", "ack"),
        ]
    run(scenario())


def test_silent_peer_times_out_on_the_fake_clock_only():
    async def scenario():
        clock = FakeClock()
        net = InMemoryNetwork(clock)
        a, b = net.transport(A), net.transport(B)
        await a.start(echo)
        await b.start(echo)
        net.silence(B)
        pending = asyncio.create_task(a.request(B, m.Ack(), timeout_s=1.0))
        await net.settle()
        clock.tick(0.999)
        await net.settle()
        assert not pending.done()
        clock.tick(0.001)
        with pytest.raises(RequestTimeout):
            await pending
        assert [e.outcome for e in net.trace] == ["dropped"]
        net.unsilence(B)
        assert await a.request(B, m.Ack()) == m.Ack()
    run(scenario())


def test_killed_peer_fails_pending_requests_at_once_and_a_restart_is_reached():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        started = asyncio.Event()

        async def hang(message: m.Message) -> m.Message | None:
            started.set()
            await asyncio.Event().wait()  # never answers: killed mid-request

        await a.start(echo)
        await b.start(hang)
        pending = asyncio.create_task(a.request(B, m.Ack(), timeout_s=60))
        await started.wait()
        await a.connect(B)
        net.kill(B)
        with pytest.raises(PeerUnreachable):
            await pending
        with pytest.raises(PeerUnreachable):
            await a.request(B, m.Ack())
        with pytest.raises(PeerUnreachable):
            await a.connect(B)
        restarted = net.transport(B)
        await restarted.start(echo)
        await a.connect(B)
        assert await a.request(B, m.Ack()) == m.Ack()
    run(scenario())


def test_handler_failure_reaches_the_requester():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)

        async def fail(message: m.Message) -> m.Message | None:
            raise KeyError("no such request")

        await a.start(echo)
        await b.start(fail)
        with pytest.raises(RemoteError) as info:
            await a.request(B, m.FreeSegment(home_inst_id=1, req_id=5, segment_id=0, reservation_id=3))
        assert info.value.code == m.ErrorCode.HANDLER_FAILED
        assert "no such request" in info.value.detail
    run(scenario())


def test_one_way_send_gets_no_reply():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        seen: list[m.Message] = []

        async def record(message: m.Message) -> m.Message | None:
            seen.append(message)
            return m.Ack()

        await a.start(echo)
        await b.start(record)
        await a.send(B, m.FreeSegment(home_inst_id=1, req_id=5, segment_id=0, reservation_id=3))
        await net.settle()
        assert seen == [m.FreeSegment(home_inst_id=1, req_id=5, segment_id=0, reservation_id=3)]
        assert net.messages() == [("memory:1", "memory:2", "free_segment")]
    run(scenario())


def test_two_instances_lending_to_each_other_do_not_deadlock():
    """Each serves the other's AttendRequest while its own step awaits a remote part."""
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)

        def attend_handler(inst_id: int):
            async def handle(message: m.Message) -> m.Message | None:
                assert isinstance(message, m.AttendRequest)
                num_rows, num_heads, _ = message.q.shape
                return m.AttendResult(message.home_inst_id, inst_id, message.step_id,
                                      message.layer, out=message.q * 2,
                                      lse=torch.zeros(num_rows, num_heads))
            return handle

        await a.start(attend_handler(1))
        await b.start(attend_handler(2))

        def request(home: int, creditor: int) -> m.AttendRequest:
            return m.AttendRequest(home, creditor, step_id=1, layer=0,
                                   slices=(m.AttendSlice(7, 0, 1, 0, 16),),
                                   q=torch.ones(1, 2, 4))

        ra, rb = await asyncio.gather(a.request(B, request(1, 2)), b.request(A, request(2, 1)))
        assert ra.creditor_inst_id == 2 and rb.creditor_inst_id == 1
        assert torch.equal(ra.out, torch.full((1, 2, 4), 2.0))
    run(scenario())


class TinyDestination:
    """A destination instance's side of a two-phase KV move, just enough for the transport."""

    def __init__(self, num_blocks: int, block_shape: tuple[int, ...]) -> None:
        self.pool = torch.zeros((num_blocks, *block_shape))
        self.free = list(range(num_blocks))
        self.reserved: dict[int, list[int]] = {}
        self.segments: dict[tuple[int, int], list[int]] = {}

    def place(self, message: m.Message):
        if not isinstance(message, m.KVBlocks):
            return None
        if message.reservation_id not in self.reserved:
            raise PlacementRefused(f"reservation {message.reservation_id} expired")
        return [self.pool[r.dst_block_id:r.dst_block_id + r.num_blocks] for r in message.runs]

    async def handle(self, message: m.Message) -> m.Message | None:
        if isinstance(message, m.TryMoveKV):
            if len(self.free) < message.num_blocks:
                return m.MoveRejected(message.move_id, m.MoveRejectReason.NO_SPACE,
                                      len(self.free))
            blocks, self.free = self.free[:message.num_blocks], self.free[message.num_blocks:]
            self.reserved[100 + message.move_id] = blocks
            return m.MoveReserved(message.move_id, 100 + message.move_id, tuple(blocks),
                                  expires_in_ms=1000)
        if isinstance(message, m.KVBlocks):
            return m.KVBlocksStored(message.move_id, message.reservation_id,
                                    sum(r.num_blocks for r in message.runs))
        if isinstance(message, m.MoveCommit):
            self.segments[(message.req_id, message.segment_id)] = \
                self.reserved.pop(message.reservation_id)
            return None
        raise ValueError(message.TYPE)


def test_two_phase_move_lands_in_the_reserved_blocks():
    async def scenario():
        net = InMemoryNetwork()
        src, dst = net.transport(A), net.transport(B)
        destination = TinyDestination(num_blocks=6, block_shape=(2, 2, 4, 1, 2))
        destination.free = [0, 1, 2, 4, 5, 3]  # the reservation is not one run
        await src.start(echo)
        await dst.start(destination.handle, destination.place)

        source_pool = torch.arange(4 * 32, dtype=torch.float32).reshape(4, 2, 2, 4, 1, 2)
        reserved = await src.request(B, m.TryMoveKV(epoch=3, move_id=1, req_id=9,
                                                   home_inst_id=1, src_inst_id=1, num_blocks=4,
                                                   block_nbytes=32 * 4))
        assert reserved == m.MoveReserved(1, 101, (0, 1, 2, 4), 1000)
        runs = [(0, 0, 3), (3, 4, 1)]  # (src block, dst block, num_blocks)
        stored = await src.request(B, m.KVBlocks(
            move_id=1, reservation_id=101,
            runs=tuple(m.BlockRun(d, n) for _, d, n in runs),
            runs_data=tuple(source_pool[s:s + n] for s, _, n in runs)))
        assert stored == m.KVBlocksStored(1, 101, 4)
        assert torch.equal(destination.pool[[0, 1, 2, 4]], source_pool)
        assert await src.request(B, m.MoveCommit(1, 101, req_id=9, home_inst_id=1,
                                                 segment_id=1)) == m.Ack()
        assert destination.segments == {(9, 1): [0, 1, 2, 4]}

        with pytest.raises(RemoteError) as info:  # the reservation is gone once committed
            await src.request(B, m.KVBlocks(1, 101, (m.BlockRun(5, 1),), (source_pool[:1],)))
        assert info.value.code == m.ErrorCode.PLACEMENT_REFUSED
        assert [t for _, _, t in net.messages()] == [
            "try_move_kv", "move_reserved", "kv_blocks", "kv_blocks_stored",
            "move_commit", "ack", "kv_blocks", "error_reply"]
    run(scenario())


def test_a_reply_that_cannot_be_encoded_is_an_error_reply_as_on_ucx():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        await a.start(echo)
        await b.start(lambda message: m.EchoReply(message.payload.view(8, 8).t()))  # not contiguous
        request = asyncio.ensure_future(a.request(B, m.Echo(torch.randn(64)), timeout_s=5))
        await net.settle()
        assert request.done()  # at once, no timeout on the fake clock
        with pytest.raises(RemoteError) as info:
            await request
        assert info.value.code == m.ErrorCode.HANDLER_FAILED and "could not be encoded" in info.value.detail
    run(scenario())


def test_a_handler_that_returns_no_message_is_answered_handler_failed_as_on_ucx():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        await a.start(echo)
        await b.start(lambda message: {"not": "a message"})
        request = asyncio.ensure_future(a.request(B, m.Echo(torch.randn(4)), timeout_s=5))
        await net.settle()
        with pytest.raises(RemoteError) as info:
            await request
        assert info.value.code == m.ErrorCode.HANDLER_FAILED
        assert info.value.detail == "TypeError: the handler returned a dict, not a message"
    run(scenario())


def test_a_killed_instance_handles_nothing_queued_to_it():
    """As a peer killed with SIGKILL runs no handler: frames on their way to it are lost."""
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)
        handled: list[str] = []
        await a.start(echo)
        await b.start(lambda message: handled.append(message.TYPE))
        await a.send(B, m.Echo(torch.ones(4)))
        net.kill(B)
        await net.settle()
        assert handled == []
    run(scenario())


def test_a_request_to_a_killed_instance_fails_for_a_requester_that_does_not_serve():
    async def scenario():
        net = InMemoryNetwork()
        a, b = net.transport(A), net.transport(B)  # a only sends requests: never started
        await b.start(echo)
        request = asyncio.ensure_future(a.request(B, m.Echo(torch.ones(4)), timeout_s=5))
        await asyncio.sleep(0)  # queued to b
        net.kill(B)
        await net.settle()
        assert request.done()
        with pytest.raises(PeerUnreachable):
            await request
    run(scenario())
