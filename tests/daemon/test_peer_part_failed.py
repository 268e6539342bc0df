"""A creditor that does not answer its part of a step surfaces as ``PeerPartFailed`` naming
it, so that the daemon can retry the step and end only the requests with KV there."""

from __future__ import annotations

import asyncio

import pytest
import torch

from infinite_llm.daemon.metrics import InstanceMetrics
from infinite_llm.daemon.peers import PeerDirectory, PeerPartFailed, TransportRemoteAttention
from infinite_llm.engine.dist_attention import AttendBatch
from infinite_llm.transport import messages as m
from infinite_llm.transport.errors import PeerUnreachable, RequestTimeout
from infinite_llm.transport.interface import PeerAddress
from infinite_llm.transport.memory import InMemoryNetwork

HOME, CREDITOR = PeerAddress("home", 1), PeerAddress("creditor", 2)


def one_entry_batch() -> AttendBatch:
    i32 = dict(dtype=torch.int32)
    return AttendBatch(step_id=7, instance_id=1, block_tables=torch.zeros(1, 1, **i32), kv_lens=torch.tensor([16], **i32),
                       kv_start_pos=torch.zeros(1, **i32), query_start_loc=torch.tensor([0, 1], **i32), q_pos=None,
                       max_query_len=1, max_kv_len=16, entry_keys=(("3", 0),), entry_rows=((0, 1, 16),))


async def home_and_creditor(serve):
    """The home's remote attention to a creditor served by ``serve``, on an in-memory network:
    (network, the creditor as a peer, the remote attention, a batch of one entry there)."""
    net = InMemoryNetwork()
    home, creditor = net.transport(HOME), net.transport(CREDITOR)
    await home.start(lambda message: None)
    await creditor.start(serve)
    peers = PeerDirectory(own_inst_id=1)
    peer = peers.update(2, CREDITOR, num_blocks_free=8, draining=False, num_blocks_total=8)
    remote = TransportRemoteAttention(home, peers, block_size=16, metrics=InstanceMetrics(), timeout_s=2.0)
    batch = AttendBatch(**{**one_entry_batch().__dict__, "instance_id": peer.engine_id})
    return net, peer, remote, batch


def run(coroutine):
    async def bounded():
        async with asyncio.timeout(20):
            return await coroutine
    return asyncio.run(bounded())


@pytest.mark.parametrize("fault", ["killed", "silent"])
def test_a_creditor_that_fails_its_part_is_named(fault):
    async def scenario():
        async def never_answer(message: m.Message) -> m.Message | None:
            await asyncio.Event().wait()

        net, peer, remote, batch = await home_and_creditor(never_answer)
        part = asyncio.ensure_future(remote.start(batch, layer=0, q=torch.zeros(1, 2, 8), sm_scale=1.0))
        for _ in range(20):  # the request reaches the creditor, which keeps it
            await asyncio.sleep(0)
        if fault == "killed":
            net.kill(CREDITOR)
        else:
            net.clock.tick(2.0)
        with pytest.raises(PeerPartFailed) as info:
            await part
        assert (info.value.inst_id, info.value.engine_id) == (2, peer.engine_id)
        assert isinstance(info.value.error, PeerUnreachable if fault == "killed" else RequestTimeout)
    run(scenario())


def test_sticky_device_errors_are_told_from_other_step_failures():
    from infinite_llm.daemon.instance import device_failed

    assert device_failed(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert device_failed(RuntimeError("CUDA error: device-side assert triggered"))
    if hasattr(torch, "AcceleratorError"):
        assert device_failed(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"))
        assert not device_failed(torch.AcceleratorError("CUDA error: invalid configuration argument"))
    assert not device_failed(RuntimeError("CUDA error: out of memory"))  # the context stays usable
    assert not device_failed(RuntimeError("request 3: cannot lend 4 blocks"))
    assert not device_failed(ValueError("CUDA error: an illegal memory access"))  # only the runtime's own errors


def bad_answers(request: m.AttendRequest) -> list[tuple[m.Message, str]]:
    """Answers to ``request`` (one row, two heads of 8) that must not be merged, and why."""
    rows, lse = torch.zeros(1, 2, 8), torch.zeros(1, 2)

    def result(**changes) -> m.AttendResult:
        fields = dict(home_inst_id=1, creditor_inst_id=2, step_id=request.step_id, layer=request.layer, out=rows, lse=lse)
        return m.AttendResult(**{**fields, **changes})
    return [
        (m.Ack(), "answered an attend request with Ack"),
        (result(step_id=request.step_id + 99), "answered step"),
        (result(layer=request.layer + 5), "answered step"),
        (result(out=torch.zeros(2, 2, 8), lse=torch.zeros(2, 2)), "rows of shape (2, 2, 8)"),
        (result(out=torch.zeros(1, 1, 8), lse=torch.zeros(1, 1)), "rows of shape (1, 1, 8)"),
        (result(out=torch.zeros(1, 2, 8, dtype=torch.int64)), "an output of torch.int64"),
        (result(lse=torch.tensor([[0.0, float("nan")]])), "log-sum-exp with NaN"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_a_creditor_part_that_cannot_be_merged_is_a_failed_part(case):
    """Wrong ids, rows, heads or dtypes, or NaN: the part is refused as if it had not come, so
    only the requests with KV on that creditor may end (merged, it would be garbage in their
    rows, or an error that ends every running request)."""
    async def scenario():
        seen: list[m.AttendRequest] = []

        async def answer_badly(message: m.Message) -> m.Message | None:
            seen.append(message)
            return bad_answers(message)[case][0]

        _net, _peer, remote, batch = await home_and_creditor(answer_badly)
        with pytest.raises(PeerPartFailed) as info:
            await remote.start(batch, layer=3, q=torch.zeros(1, 2, 8), sm_scale=1.0)
        assert info.value.inst_id == 2 and bad_answers(seen[0])[case][1] in str(info.value.error)
    run(scenario())
