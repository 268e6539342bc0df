"""Two homes whose long prompts both need the same peer memory: real `infinited` processes.

Each home's prompt needs more blocks than its own pool, and the cluster cannot hold both at
once. A home asks its peers to keep blocks for a request before it starts (``HoldKV``), and a
peer keeps them first come, first served: one request runs while the other waits, and both end
with the tokens of one large instance. Counted on the peers' published free blocks alone, both
would start on the same memory and then preempt each other.
"""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch

from infinite_llm.daemon.local_cluster import Generation, LocalCluster, passkey_prompt
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams

HOME_BLOCKS, PEER_BLOCKS = 26, 32
# About 43 blocks each: more than a home's pool, and two are more than the three pools hold.
PROMPTS = {1: passkey_prompt(45, key_item=5), 2: passkey_prompt(45, key_item=22)}
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("holds"), num_instances=3, pool_blocks=HOME_BLOCKS,
                           pool_blocks_per_instance=[HOME_BLOCKS, HOME_BLOCKS, PEER_BLOCKS])
    try:
        cluster.wait_ready()
        yield cluster
    finally:
        cluster.stop()


def reference_tokens(prompts: list[str]) -> list[list[int]]:
    """Each prompt's tokens from one large instance, one prompt after the other (one engine:
    loading the checkpoint takes about 4 s)."""
    torch.set_num_threads(1)
    engine = LLMEngine(load_checkpoint(None, show_progress=False),
                       EngineConfig(block_size=16, pool_blocks=(256,), max_num_batched_tokens=128))
    return [list(output.token_ids) for prompt in prompts
            for output in engine.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))]


def serve_both(cluster: LocalCluster) -> dict[int, Generation]:
    """Both long requests at once, one on each home; asserts that they never both ran."""
    generations = {i: Generation(cluster[i], PROMPTS[i], NEW_TOKENS, timeout_s=300.0) for i in (1, 2)}
    both_running = False
    deadline = time.monotonic() + 300
    while any(g.thread.is_alive() for g in generations.values()) and time.monotonic() < deadline:
        states = [{r["state"] for r in cluster[i].status()["requests"]} for i in (1, 2)]
        both_running |= all("running" in s for s in states)
        time.sleep(0.05)
    for g in generations.values():
        g.thread.join(timeout=10)
        assert g.error is None and g.finish_reason == "length", (g.error, g.finish_reason)
    assert not both_running, "both long requests ran at once on the same peer memory"
    return generations


def test_two_homes_never_both_start_on_the_same_peer_memory(cluster):
    # The references are computed in this process while the cluster serves them (one long
    # request runs at a time there, leaving most of a core idle).
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        references = pool.submit(reference_tokens, [PROMPTS[1], PROMPTS[2]])
        generations = serve_both(cluster)
        expected = references.result()
    for i in (1, 2):
        assert generations[i].tokens == expected[i - 1]
    # Done: nothing is kept or held for anyone.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(
            inst.status()["pool"]["num_blocks_held_for_others"] or inst.status()["holds"] for inst in cluster):
        time.sleep(0.1)
    for inst in cluster:
        status = inst.status()
        assert status["holds"] == [] and status["pool"]["num_blocks_held_for_others"] == 0
