"""A creditor pool lost mid-request: the request recomputes only the lost tokens and goes on.

The lost pool is filled with NaN once it is dropped, so a step that still read it would sample
garbage: tokens identical to the undisturbed run say that only the recomputed KV was used.
"""

from __future__ import annotations

import math

import pytest

from infinite_llm.engine.block_manager import BlockManager
from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams
from infinite_llm.engine.scheduler import Request, RequestStatus, Scheduler

BLOCK_SIZE = 4


def _engine(smollm2, pool_blocks=(256, 64, 64), max_num_batched_tokens=16) -> LLMEngine:
    return LLMEngine(smollm2, EngineConfig(block_size=BLOCK_SIZE, pool_blocks=pool_blocks,
                                           max_num_batched_tokens=max_num_batched_tokens, spill_to_creditors=False))


def _run(engine: LLMEngine, prompts, num_tokens: int, at_step=None) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=num_tokens, ignore_eos=True)) for p in prompts]
    tokens = {i: [] for i in ids}
    step = 0
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
        if at_step is not None:
            at_step(engine, step)
        step += 1
        assert step < 2000
    return [tokens[i] for i in ids]


def _lend_to(engine: LLMEngine, request_id: str, num_blocks: int, dst: int) -> None:
    request = engine.scheduler.requests[request_id]
    if engine.block_manager.num_lendable_blocks(request_id, request.num_computed_tokens) >= num_blocks:
        engine.lend(request_id, num_blocks, dst)


@pytest.fixture(scope="module")
def undisturbed(smollm2, prompt_token_ids):
    return _run(_engine(smollm2), prompt_token_ids[:3], 12)


def test_a_lost_pool_is_recomputed_and_the_tokens_do_not_change(smollm2, prompt_token_ids, undisturbed):
    events = {}

    def plan(engine: LLMEngine, step: int) -> None:
        # Steps 0-5: lend blocks of request 0 to pool 1 and of request 1 to pools 1 and 2.
        if step in (2, 4):
            _lend_to(engine, "0", 2, 1)
            _lend_to(engine, "1", 1, 2)
            _lend_to(engine, "1", 1, 1)
        if step == 6:
            before = {r: engine.placement(r) for r in ("0", "1", "2")}
            assert any(s.instance_id == 1 for s in before["0"])
            lost = engine.recover_lost(1)
            engine.pools[1].fill_(math.nan)  # its KV is gone: nothing may read it again
            events["lost"] = lost
            assert set(lost.recomputing) == {r for r, t in before.items() if any(s.instance_id == 1 for s in t)}
            assert lost.unrecoverable == ()
            for request_id, segments in lost.segments.items():
                assert sum(s.num_tokens for s in segments) == lost.recomputing[request_id]
            assert engine.block_manager.num_free_blocks(1) == 64
            # Pool 2 still holds request 1's segment: its recompute attends over it there.
            assert any(s.instance_id == 2 for s in engine.placement("1"))
        if "lost" in events and step > 6:
            for request_id in ("0", "1", "2"):
                if engine.scheduler.requests.get(request_id) is not None:
                    assert all(s.instance_id != 1 for s in engine.placement(request_id))

    engine = _engine(smollm2)
    tokens = _run(engine, prompt_token_ids[:3], 12, plan)
    assert tokens == undisturbed
    recovered = {r.request_id: r for r in engine.recovered}
    assert set(recovered) == set(events["lost"].recomputing)
    for request_id, r in recovered.items():
        assert r.num_tokens == events["lost"].recomputing[request_id] and r.num_segments >= 1 and r.seconds >= 0
    assert engine.block_manager.num_free_blocks(0) == 256 and engine.block_manager.num_free_blocks(2) == 64


def test_a_long_lost_range_is_recomputed_in_chunks_between_other_requests(smollm2, prompt_token_ids):
    """The lost range is longer than a step's token budget: it takes several chunks, while the
    other request keeps decoding."""
    prompts = [prompt_token_ids[1], prompt_token_ids[0]]  # request 0 the longer
    reference = _run(_engine(smollm2, max_num_batched_tokens=64), prompts, 10)
    seen = {"recompute_steps": 0}

    def plan(engine: LLMEngine, step: int) -> None:
        if step == 1:
            request = engine.scheduler.requests["0"]
            lendable = engine.block_manager.num_lendable_blocks("0", request.num_computed_tokens)
            assert lendable >= 3
            engine.lend("0", lendable, 1)
        if step == 2:
            lost = engine.recover_lost(1)
            engine.pools[1].fill_(math.nan)
            assert lost.recomputing["0"] > 8
            engine.scheduler.max_num_batched_tokens = 8  # smaller chunks from here
        if step > 2 and engine.block_manager.has_lost("0"):
            seen["recompute_steps"] += 1

    tokens = _run(_engine(smollm2, max_num_batched_tokens=64), prompts, 10, plan)
    assert tokens == reference
    assert seen["recompute_steps"] >= 1  # a step ended with part of the range still lost


def test_lost_kv_that_fits_nowhere_is_reported_unrecoverable(smollm2, prompt_token_ids):
    engine = LLMEngine(smollm2, EngineConfig(block_size=BLOCK_SIZE, pool_blocks=(24, 64), max_num_batched_tokens=16,
                                             spill_to_creditors=True))
    request_id = engine.add_request(prompt_token_ids[4][:120], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.scheduler.requests[request_id].num_computed_tokens < 110:
        engine.step()
    bm = engine.block_manager
    lent = sum(len(s.block_ids) for s in engine.placement(request_id) if s.instance_id == 1)
    assert lent > bm.num_free_blocks(0)
    # The home pool cannot hold the lost blocks, and no other creditor has room.
    lost = engine.recover_lost(1, blocks_elsewhere=0)
    assert lost.unrecoverable == (request_id,) and lost.recomputing == {}
    engine.abort(request_id)
    assert bm.num_free_blocks(0) == 24 and bm.num_free_blocks(1) == 64 and not engine.has_unfinished


# ---- block accounting and scheduling, without a model ---------------------------------------


def _table_with_lent(bm: BlockManager, request_id: str, lend_to: tuple[tuple[int, int], ...], num_tokens: int):
    bm.allocate(request_id, num_tokens)
    for num_blocks, dst in lend_to:
        bm.commit_move(bm.lend(request_id, num_blocks, dst, num_tokens))


def test_drop_instance_leaves_gaps_that_fill_in_token_order():
    bm = BlockManager(4, (32, 16, 16))
    _table_with_lent(bm, "r", ((2, 1), (1, 2), (2, 1)), 30)
    before = bm.block_table("r")
    assert [s.instance_id for s in before] == [1, 2, 1, 0]
    lost = bm.drop_instance(1)
    assert [(s.token_start, s.num_tokens) for s in lost["r"]] == [(0, 8), (12, 8)]
    assert bm.num_free_blocks(1) == 16 and bm.has_lost("r") and bm.num_lost_tokens("r") == 16
    assert bm.lost_range("r") == (0, 8) and bm.num_tokens("r") == 30
    assert bm.fill_end("r", 6) == 4  # a block boundary
    assert bm.fill_end("r", 3) == 0  # not one block: nothing this step
    bm.fill_lost("r", 4)
    assert bm.lost_range("r") == (4, 8)
    assert bm.slot_mapping("r", 0, 4)[0] // 4 == bm.block_table("r")[0].block_ids[0]
    with pytest.raises(ValueError):
        bm.fill_lost("r", 6)  # inside a block, and not the range's end
    bm.fill_lost("r", 8)
    assert bm.lost_range("r") == (12, 20)
    bm.fill_lost("r", 20)
    assert not bm.has_lost("r")
    table = bm.block_table("r")
    assert [(s.instance_id, s.token_start, s.token_end) for s in table] == [(0, 0, 8), (2, 8, 12), (0, 12, 30)]
    bm.free("r")
    assert [bm.num_free_blocks(i) for i in range(3)] == [32, 16, 16]


def test_drop_instance_cancels_moves_to_it():
    bm = BlockManager(4, (32, 16))
    bm.allocate("r", 16)
    move = bm.lend("r", 2, 1, 16)
    assert bm.drop_instance(1) == {}
    with pytest.raises(ValueError):
        bm.commit_move(move)  # cancelled: the move's switch fails and is undone by its owner
    assert bm.num_free_blocks(1) == 16 and [s.instance_id for s in bm.block_table("r")] == [0]


def test_the_scheduler_recomputes_before_it_decodes_and_preempts_for_room():
    bm = BlockManager(4, (5, 16))
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    old = Request("old", list(range(16)), SamplingParams(max_tokens=50))
    scheduler.add(old)
    (chunk,) = scheduler.schedule().chunks
    old.num_computed_tokens = 16
    old.output_token_ids.append(7)
    bm.commit_move(bm.lend("old", 4, 1, 16))
    new = Request("new", list(range(20)), SamplingParams(max_tokens=50))
    scheduler.add(new)
    out = scheduler.schedule()  # old decodes, new takes the rest of the budget: no home block is left
    assert [c.request_id for c in out.chunks] == ["old", "new"] and bm.num_free_blocks(0) == 0
    new.num_computed_tokens = 15
    bm.drop_instance(1)
    assert bm.lost_range("old") == (0, 16)
    out = scheduler.schedule()
    assert out.chunks == (type(chunk)("old", 0, 16, samples=False, recomputes=True),)
    # Home blocks ran short: the newest request gave its blocks back for the recompute.
    assert out.preempted == ("new",) and new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert not bm.has_lost("old") and old.num_computed_tokens == 16
    out = scheduler.schedule()
    assert out.chunks[0].request_id == "old" and out.chunks[0].start == 16 and out.chunks[0].samples
    assert not out.chunks[0].recomputes
