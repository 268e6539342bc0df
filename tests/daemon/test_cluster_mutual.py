"""Two `infinited` processes holding each other's KV while both decode; moves under load.

While a request decodes on each instance, a leader's ``MoveKV`` moves old blocks of each one to
the other. From then on every step of each instance awaits the other's attention while serving
the other's attend requests: neither may deadlock, and the tokens must not change.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.messages import Ack, MoveKV

from infinite_llm.daemon.local_cluster import LocalCluster, passkey_prompt

POOL_BLOCKS = 40
PROMPTS = {1: passkey_prompt(20, key_item=7), 2: passkey_prompt(20, key_item=13)}  # about 19 blocks each
NEW_TOKENS = 64
MOVED_BLOCKS = 5


# Each home attends over the other's KV by a message a layer, or through step mailboxes (one
# StepBegin a step; each instance's creditor work on a thread of its own beside its own step).
# The message path is what every other cluster test on the CPU runs: its pair is under `slow`.
@pytest.fixture(scope="module", params=[pytest.param("messages", marks=pytest.mark.slow), "mailboxes"])
def pair(tmp_path_factory, request):
    cluster = LocalCluster(tmp_path_factory.mktemp("pair"), num_instances=2, pool_blocks=POOL_BLOCKS,
                           extra_args=["--remote-attention", request.param])
    cluster.remote_attention = request.param
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def peer_address(cluster: LocalCluster, inst_id: int) -> PeerAddress:
    member = json.loads((cluster.state_dir / "members" / f"{inst_id}.json").read_text())
    return PeerAddress(member["peer_host"], member["peer_port"])


async def send_as_leader(messages: list[tuple[PeerAddress, MoveKV]]) -> list[object]:
    """Send gManager commands from a transport of this process; returns each reply or error."""
    from infinite_llm.transport.ucx import UcxTransport

    # Loopback without a GPU: what the daemons use too (the cluster helper sets it for them).
    os.environ.setdefault("UCX_TLS", "tcp,sm,self")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    transport = UcxTransport(TransportConfig(request_timeout_s=60.0))

    async def no_requests(message):
        raise ValueError("the test's transport serves nothing")

    await transport.start(no_requests)
    try:
        return await asyncio.gather(*(transport.request(a, m, timeout_s=60.0) for a, m in messages),
                                    return_exceptions=True)
    finally:
        await transport.close()


def test_moves_both_ways_under_load_without_deadlock(pair):
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i=i: results.update(
        {i: pair[i].generate(PROMPTS[i], max_tokens=NEW_TOKENS, ignore_eos=True)})) for i in PROMPTS]
    for t in threads:
        t.start()
    # Wait until both requests are decoding.
    request_ids = {}
    deadline = time.monotonic() + 120
    while len(request_ids) < 2 and time.monotonic() < deadline:
        for i in PROMPTS:
            for r in pair[i].status()["requests"]:
                if r["state"] == "running" and r["num_tokens"] > 300:
                    request_ids[i] = int(r["request_id"])
        time.sleep(0.05)
    assert len(request_ids) == 2, "both requests should be decoding"

    replies = asyncio.run(send_as_leader([
        (peer_address(pair, 1), MoveKV(epoch=1, move_id=1, home_inst_id=1, req_id=request_ids[1], src_inst_id=1,
                                       dst_inst_id=2, num_blocks=MOVED_BLOCKS)),
        (peer_address(pair, 2), MoveKV(epoch=1, move_id=2, home_inst_id=2, req_id=request_ids[2], src_inst_id=2,
                                       dst_inst_id=1, num_blocks=MOVED_BLOCKS)),
    ]))
    assert all(isinstance(r, Ack) for r in replies), replies
    held = {i: pair[i].status()["held_segments"] for i in PROMPTS}
    assert [s["num_blocks"] for s in held[2] if s["home_instance_id"] == 1] == [MOVED_BLOCKS]
    assert [s["num_blocks"] for s in held[1] if s["home_instance_id"] == 2] == [MOVED_BLOCKS]
    placement = pair[1].status()["requests"][0]["segments"]
    assert placement[0]["instance_id"] == 2 and placement[0]["token_start"] == 0
    assert placement[0]["num_tokens"] == MOVED_BLOCKS * 16

    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a home never finished: the instances deadlocked"
    if pair.remote_attention == "mailboxes":
        for i in PROMPTS:
            steps = pair[i].status()["step_protocol"]
            assert steps["home_steps_on_mailboxes"] > 0 and steps["creditor_steps_begun"] > 0, (i, steps)
            assert steps["home_steps_failed"] == 0 and steps["creditor_steps_timed_out"] == 0, (i, steps)

    torch.set_num_threads(1)
    reference = LLMEngine(load_checkpoint(None, show_progress=False),
                          EngineConfig(block_size=16, pool_blocks=(512,), max_num_batched_tokens=128))
    for i, prompt in PROMPTS.items():
        (expected,) = reference.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert results[i][0] == list(expected.token_ids)
    for i in PROMPTS:
        assert pair[i].status()["pool"]["num_blocks_free"] == POOL_BLOCKS


def test_commands_of_a_deposed_leader_are_refused_and_counted(pair):
    before = pair[1].status()["stale_epoch_commands"]
    (reply,) = asyncio.run(send_as_leader([
        (peer_address(pair, 1), MoveKV(epoch=0, move_id=9, home_inst_id=1, req_id=1, src_inst_id=1,
                                       dst_inst_id=2, num_blocks=1)),
    ]))
    assert isinstance(reply, RemoteError) and "epoch 0 is older than 1" in str(reply)
    assert pair[1].status()["stale_epoch_commands"] == before + 1
