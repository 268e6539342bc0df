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
                       max_query_len=1, max_kv_len=16, entry_keys=(("3", 0),))


def run(coroutine):
    async def bounded():
        async with asyncio.timeout(20):
            return await coroutine
    return asyncio.run(bounded())


@pytest.mark.parametrize("fault", ["killed", "silent"])
def test_a_creditor_that_fails_its_part_is_named(fault):
    async def scenario():
        net = InMemoryNetwork()
        home, creditor = net.transport(HOME), net.transport(CREDITOR)

        async def never_answer(message: m.Message) -> m.Message | None:
            await asyncio.Event().wait()

        await home.start(lambda message: None)
        await creditor.start(never_answer)
        peers = PeerDirectory(own_inst_id=1)
        peer = peers.update(2, CREDITOR, num_blocks_free=8, draining=False, num_blocks_total=8)
        remote = TransportRemoteAttention(home, peers, block_size=16, metrics=InstanceMetrics(), timeout_s=2.0)
        batch = one_entry_batch()
        batch = AttendBatch(**{**batch.__dict__, "instance_id": peer.engine_id})
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
