"""KV cut over several in-process pools gives the same greedy tokens as one pool."""

import concurrent.futures

import pytest
import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams

# Blocks lent per move, cycled so that segments come in different sizes.
LEND_SIZES = (3, 1, 5, 2)


def _greedy(engine: LLMEngine, prompts, num_tokens, lend_plan=None):
    """Run prompts together; after every step ``lend_plan(engine, step)`` may move KV."""
    ids = [engine.add_request(p, SamplingParams(max_tokens=num_tokens, ignore_eos=True)) for p in prompts]
    tokens = {i: [] for i in ids}
    placements = []
    step = 0
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        if lend_plan is not None:
            lend_plan(engine, step)
        placements.append({i: engine.placement(i) for i in ids if engine.scheduler.requests.get(i)})
        step += 1
    return [tokens[i] for i in ids], placements


def _round_robin_lender(num_pools: int, lone_request: str | None):
    """Lend blocks of every running request to pools 1..num_pools-1 in turn, sizes cycling.

    The last pool gets exactly one segment, of ``lone_request`` only (when given): a pool that
    holds nothing else.
    """
    counter = {"n": 0}
    shared = list(range(1, num_pools - 1 if lone_request else num_pools))
    lone_done = {"done": lone_request is None}

    def lend(engine: LLMEngine, step: int) -> None:
        for request in list(engine.scheduler.running):
            written = request.num_computed_tokens
            lendable = engine.block_manager.num_lendable_blocks(request.request_id, written)
            if not lone_done["done"] and request.request_id == lone_request:
                if lendable >= 2:
                    engine.lend(request.request_id, 2, num_pools - 1)
                    lone_done["done"] = True
                continue
            if not shared:
                continue
            size = LEND_SIZES[counter["n"] % len(LEND_SIZES)]
            dst = shared[counter["n"] % len(shared)]
            if lendable >= size and engine.block_manager.num_free_blocks(dst) >= size:
                engine.lend(request.request_id, size, dst)
                counter["n"] += 1

    return lend


@pytest.fixture(scope="module")
def single_pool_tokens(smollm2, prompt_token_ids):
    """The four short prompts' tokens from one pool."""
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(1024,), max_num_batched_tokens=512))
    short, _ = _greedy(engine, prompt_token_ids[:4], 10)
    return short


@pytest.fixture(scope="module")
def long_single_pool_tokens(smollm2, prompt_token_ids):
    """The long prompt's tokens from one pool, as a future: the 4K prefill (about 20 s on one
    torch thread) runs in a thread of its own while the first test that asks for it runs its
    own engine, on one thread too (the one_thread fixture), on the other core."""
    def run() -> list[int]:
        torch.set_num_threads(1)  # this module fixture is set up before one_thread sets it
        engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(1024,), max_num_batched_tokens=512))
        (tokens,), _ = _greedy(engine, prompt_token_ids[4:], 3)
        return tokens

    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        yield pool.submit(run)


@pytest.mark.parametrize("num_pools", [2, 3, 4])
def test_short_prompts_over_several_pools(smollm2, prompt_token_ids, single_pool_tokens, num_pools):
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(256,) + (128,) * (num_pools - 1),
                                             max_num_batched_tokens=16, spill_to_creditors=False))
    lender = _round_robin_lender(num_pools, lone_request="0" if num_pools == 4 else None)
    tokens, placements = _greedy(engine, prompt_token_ids[:4], 10, lender)
    assert tokens == single_pool_tokens[:4]
    used = {s.instance_id for p in placements for table in p.values() for s in table}
    assert used == set(range(num_pools))
    sizes = {len(s.block_ids) for p in placements for table in p.values() for s in table if s.instance_id != 0}
    assert len(sizes) > 1  # segments of different sizes
    if num_pools == 4:
        lone = [(rid, s) for p in placements for rid, table in p.items() for s in table if s.instance_id == 3]
        assert {rid for rid, _ in lone} == {"0"}


def _long_prompt_over(smollm2, prompt, num_pools, expected: concurrent.futures.Future):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(512,) + (128,) * (num_pools - 1),
                                             max_num_batched_tokens=512, spill_to_creditors=False))
    tokens, placements = _greedy(engine, [prompt], 3, _round_robin_lender(num_pools, "0" if num_pools > 2 else None))
    assert tokens == [expected.result()]
    last = [p["0"] for p in placements if "0" in p][-1]
    assert {s.instance_id for s in last} == set(range(num_pools))


def test_long_prompt_over_two_pools(smollm2, prompt_token_ids, long_single_pool_tokens):
    _long_prompt_over(smollm2, prompt_token_ids[4], 2, long_single_pool_tokens)


@pytest.mark.slow
@pytest.mark.parametrize("num_pools", [3, 4])
def test_long_prompt_over_more_pools(smollm2, prompt_token_ids, long_single_pool_tokens, num_pools):
    _long_prompt_over(smollm2, prompt_token_ids[4], num_pools, long_single_pool_tokens)


def test_home_pool_too_small_spills_to_creditors(smollm2, prompt_token_ids, single_pool_tokens):
    """A 24-block home pool cannot hold a 200-token request: old blocks go to creditors by themselves."""
    prompt = prompt_token_ids[4][:200]
    reference = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,), max_num_batched_tokens=64))
    expected, _ = _greedy(reference, [prompt], 6)
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(24, 30, 30), max_num_batched_tokens=32))
    tokens, placements = _greedy(engine, [prompt], 6)
    assert tokens == expected
    assert max(len(p.get("0", ())) for p in placements) >= 3
    assert engine.remote.num_calls % smollm2.config.num_layers == 0 and engine.remote.num_calls > 0


def test_taking_a_segment_back_keeps_the_tokens(smollm2, prompt_token_ids, single_pool_tokens):
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(128, 64), max_num_batched_tokens=16,
                                             spill_to_creditors=False))

    def lend_then_take_back(engine, step):
        if step == 4:
            engine.lend("0", 2, 1)
            assert engine.placement("0")[0].instance_id == 1
        if step == 6:
            engine.take_back("0", 0)
            assert all(s.instance_id == 0 for s in engine.placement("0"))

    tokens, _ = _greedy(engine, prompt_token_ids[:1], 10, lend_then_take_back)
    assert tokens == single_pool_tokens[:1]


def test_split_decodes_one_step_in_three_keep_their_tokens(smollm2, prompt_token_ids, single_pool_tokens):
    """Request "0" is split from its fourth step on and then decodes one step in three beside
    "1" (all at home): both give the tokens they give alone, and "1" finishes first."""
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(256, 64), max_num_batched_tokens=512,
                                             spill_to_creditors=False, split_decode_interval=3))
    finished_at = {}

    def lend_once(engine, step):
        if step == 3:
            engine.lend("0", 2, 1)
        for request_id in ("0", "1"):
            if request_id not in engine.scheduler.requests:
                finished_at.setdefault(request_id, step)

    tokens, _ = _greedy(engine, prompt_token_ids[:2], 10, lend_once)
    assert tokens == single_pool_tokens[:2]
    assert finished_at["1"] < finished_at["0"]
