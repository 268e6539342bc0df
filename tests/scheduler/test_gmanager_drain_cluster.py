"""End to end: a gManager drains an instance of a real three-instance cluster under load.

Instance 1 decodes a long request whose KV spills onto instances 2 and 3; instance 2 decodes a
request of its own. A drain of instance 3 is refused (instance 2 lacks room for what 3 holds)
and moves nothing. A drain of instance 2 moves the segments it holds for instance 1 to
instance 3 (a creditor-to-creditor move, driven by instance 1 between its steps) and its own
request's full blocks away; both requests finish with the tokens of an undisturbed run, and
instance 2 ends with no block in use and safe to stop.
"""

from __future__ import annotations


import pytest
import torch

from infinite_llm.daemon.local_cluster import Generation, LocalCluster, passkey_prompt, wait_for
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.loader import load_checkpoint
from infinite_llm.engine.sampling import SamplingParams
from gmanager_testlib import GManagerProcess

# Instance 1's long prompt (about 75 blocks of 16 tokens) overflows its 40 blocks. It spills
# to the peer with the most free blocks: instance 3 (64) first, then both in turn.
POOLS = [40, 40, 64]
LONG_PROMPT = passkey_prompt(75)
LONG_TOKENS = 120
SHORT_PROMPT = passkey_prompt(10, key_item=3)  # about 10 blocks, on instance 2
# Long enough to be decoding still when the drain of instance 3 is asked for: its blocks are
# what leaves instance 2 short of room for what instance 3 holds.
SHORT_TOKENS = 200


def decoding_request(instance, min_tokens: int) -> dict | None:
    for request in instance.status()["requests"]:
        if request["state"] == "running" and request["num_tokens"] > min_tokens:
            return request
    return None


@pytest.fixture(scope="module")
def reference_engine():
    """One engine with room for everything, in this process: the undisturbed run."""
    torch.set_num_threads(1)
    return LLMEngine(load_checkpoint(None, show_progress=False),
                     EngineConfig(block_size=16, pool_blocks=(256,), max_num_batched_tokens=128))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("drain")
    cluster = LocalCluster(root, num_instances=3, pool_blocks=0, pool_blocks_per_instance=POOLS)
    gmanager = GManagerProcess(cluster.state_dir, "gm", [
        "--heartbeat-interval-s", "1", "--block-size", "16", "--move-timeout-s", "30",
        "--plan-interval-s", "3600"])  # no policy round: only the drain moves blocks
    try:
        cluster.wait_ready()
        gmanager.wait_leading()
        yield cluster, gmanager
    finally:
        cluster.stop()
        gmanager.stop()


# About 80 s on a 2-core machine: under `slow`. The default run drains through infctl
# (tests/cli/test_infctl.py) and the gManager's drain logic on its own (test_gmanager_drain.py).
@pytest.mark.slow
def test_drain_moves_lent_segments_and_requests_away_with_unchanged_outputs(cluster, reference_engine):
    cluster, gmanager = cluster
    long_len = len(reference_engine.tokenizer.encode(LONG_PROMPT))
    short_len = len(reference_engine.tokenizer.encode(SHORT_PROMPT))
    long_run = Generation(cluster[1], LONG_PROMPT, LONG_TOKENS)
    wait_for("instance 1's request decodes with KV on 2 and 3",
             lambda: (r := decoding_request(cluster[1], long_len)) and {s["instance_id"] for s in r["segments"]} >= {1, 2, 3})
    short_run = Generation(cluster[2], SHORT_PROMPT, SHORT_TOKENS)
    wait_for("instance 2's request decodes", lambda: decoding_request(cluster[2], short_len))

    # Once the heartbeats show both, a dry run plans both kinds of move and sends nothing.
    def planned() -> list[dict] | None:
        code, plan = gmanager.request("POST", "/v1/drain", {"instance_id": 2, "dry_run": True})
        assert code == 200, plan
        kinds = {m["kind"] for m in plan["moves"]}
        return plan["moves"] if kinds == {"held", "own"} else None
    moves = wait_for("the gManager sees both requests", planned, timeout_s=30, interval_s=0.5)
    assert all(m["dst_inst_id"] == 3 for m in moves if m["kind"] == "held")  # never back to the home

    # Instance 3 holds more for instance 1 than instance 2 has free: refused, nothing moved.
    assert decoding_request(cluster[2], short_len), "instance 2's request ended before the drain of 3"
    code, refused = gmanager.request("POST", "/v1/drain", {"instance_id": 3})
    assert code == 409 and "drain refused, nothing moved" in refused["error"], refused
    assert gmanager.status()["moves"] == {}
    assert cluster[3].status()["draining"] is False
    code, unknown = gmanager.request("POST", "/v1/drain", {"instance_id": 9})
    assert code == 404 and "unknown instance 9" in unknown["error"]

    code, report = gmanager.request("POST", "/v1/drain", {"instance_id": 2})
    assert code == 200 and report["draining"] and report["planned_moves"], report
    assert cluster[2].status()["draining"] is True
    code, body = cluster[2].local("POST", "/v1/generate", {"prompt": "Hello", "params": {"max_tokens": 2}})
    assert code == 503 and "draining" in body["error"]

    # The segments instance 2 held for instance 1 leave while instance 1 still decodes.
    wait_for("instance 2 holds nothing for others",
             lambda: cluster[2].status()["pool"]["num_blocks_held_for_others"] == 0)
    assert long_run.thread.is_alive(), "instance 1's request should still decode after the move"

    def drained() -> dict | None:
        code, status = gmanager.request("GET", "/v1/drain/2")
        assert code == 200, status
        return status if status["safe_to_stop"] else None
    final = wait_for("the drain reports safe to stop", drained)
    # Over all rounds (the report lists only the latest round's moves).
    results = final["move_results"]
    assert results["held"].get("committed", 0) >= 1 and results["own"].get("committed", 0) >= 1, results
    assert (final["running_requests"], final["blocks_held_for_others"]) == (0, 0)
    assert any(i["instance_id"] == 2 and i["draining"] for i in gmanager.status()["instances"])

    long_tokens, short_tokens = long_run.join(), short_run.join()
    pool = cluster[2].status()["pool"]
    assert pool["num_blocks_free"] == pool["num_blocks_total"] == POOLS[1]
    assert pool["num_blocks_held_for_others"] == 0 and pool["num_blocks_reserved_for_others"] == 0

    # The tokens of an undisturbed run, each request alone on one instance with room for it.
    (expected_long,) = reference_engine.generate([LONG_PROMPT], SamplingParams(max_tokens=LONG_TOKENS, ignore_eos=True))
    (expected_short,) = reference_engine.generate([SHORT_PROMPT], SamplingParams(max_tokens=SHORT_TOKENS, ignore_eos=True))
    assert long_tokens == list(expected_long.token_ids)
    assert short_tokens == list(expected_short.token_ids)
