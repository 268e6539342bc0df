"""Scheduling without a model: chunks, budgets, admission, preemption."""

import pytest

from infinite_llm.engine.block_manager import BlockManager
from infinite_llm.engine.sampling import SamplingParams
from infinite_llm.engine.scheduler import Request, RequestStatus, ScheduledChunk, Scheduler


def _request(request_id: str, num_prompt: int) -> Request:
    return Request(request_id, list(range(num_prompt)), SamplingParams(max_tokens=4))


def _run(scheduler: Scheduler) -> list[ScheduledChunk]:
    """One step as the engine does it: schedule, then mark the tokens computed and sample."""
    out = scheduler.schedule()
    for chunk in out.chunks:
        request = scheduler.requests[chunk.request_id]
        request.num_computed_tokens = chunk.start + chunk.num_tokens
        if chunk.samples:
            request.output_token_ids.append(7)
    return list(out.chunks)


def test_long_prompt_is_prefilled_in_chunks_then_decodes():
    scheduler = Scheduler(BlockManager(4, [64]), max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(_request("a", 20))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 8, False)]
    assert _run(scheduler) == [ScheduledChunk("a", 8, 8, False)]
    assert _run(scheduler) == [ScheduledChunk("a", 16, 4, True)]
    assert _run(scheduler) == [ScheduledChunk("a", 20, 1, True)]


def test_new_requests_join_while_others_decode():
    scheduler = Scheduler(BlockManager(4, [64]), max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(_request("a", 3))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 3, True)]
    scheduler.add(_request("b", 10))
    assert _run(scheduler) == [ScheduledChunk("a", 3, 1, True), ScheduledChunk("b", 0, 7, False)]
    assert _run(scheduler) == [ScheduledChunk("a", 4, 1, True), ScheduledChunk("b", 7, 3, True)]


def test_max_num_seqs_bounds_the_running_set():
    scheduler = Scheduler(BlockManager(4, [64]), max_num_seqs=2, max_num_batched_tokens=16)
    for name in "abc":
        scheduler.add(_request(name, 2))
    assert [c.request_id for c in _run(scheduler)] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    scheduler.finish("a")
    assert [c.request_id for c in _run(scheduler)] == ["b", "c"]


def test_a_request_without_blocks_waits_first_come_first_served():
    bm = BlockManager(4, [3])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add(_request("a", 8))
    scheduler.add(_request("b", 8))
    scheduler.add(_request("c", 1))
    assert [c.request_id for c in _run(scheduler)] == ["a"]  # b needs 2 blocks, 1 is free; c waits behind b
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    scheduler.finish("a")
    assert [c.request_id for c in _run(scheduler)] == ["b", "c"]


def test_preemption_frees_the_newest_request_and_recomputes_it():
    bm = BlockManager(2, [4])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(_request("a", 4))
    scheduler.add(_request("b", 4))
    _run(scheduler)  # both prefilled: 4 blocks used, each request sampled one token
    out = scheduler.schedule()  # a's 5th token needs a block: b gives its blocks back
    assert out.preempted == ("b",)
    assert out.chunks == (ScheduledChunk("a", 4, 1, True),)
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.output_token_ids) == (RequestStatus.WAITING, 0, [7])
    assert bm.block_table("b") == ()
    assert len(bm.block_table("a")[0].block_ids) == 3


def test_a_waiting_request_starts_only_when_can_start_says_so_first_come_first_served():
    free_elsewhere = {"blocks": 0}
    bm = BlockManager(4, [8])

    def fits(request: Request) -> bool:  # as the engine's check with peers: the whole context
        return -(-request.num_tokens // 4) <= bm.num_free_blocks(0) + free_elsewhere["blocks"]

    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8, can_start=fits)
    scheduler.add(_request("long", 40))  # 10 blocks: more than the home's 8
    scheduler.add(_request("short", 4))
    assert _run(scheduler) == []  # the head waits, and the one behind it too
    free_elsewhere["blocks"] = 2
    assert _run(scheduler) == [ScheduledChunk("long", 0, 8, False)]


def test_requests_behind_one_that_cannot_start_go_ahead_up_to_the_limit():
    """"long" cannot start (can_start says no); with a limit of 2, "s1" and "s2" start ahead of
    it, then the queue waits for it ("s3" does not start) until it can."""
    long_may_start = {"yes": False}
    scheduler = Scheduler(BlockManager(4, [64]), max_num_seqs=8, max_num_batched_tokens=64, queue_bypass_limit=2,
                          can_start=lambda r: r.request_id != "long" or long_may_start["yes"])
    for request_id, length in (("long", 20), ("s1", 3), ("s2", 3), ("s3", 3)):
        scheduler.add(_request(request_id, length))
    assert [c.request_id for c in _run(scheduler)] == ["s1", "s2"]
    assert [r.request_id for r in scheduler.waiting] == ["long", "s3"]
    assert scheduler.requests["long"].num_bypassed == 2
    assert [c.request_id for c in _run(scheduler)] == ["s1", "s2"]  # "s3" waits behind "long"
    long_may_start["yes"] = True
    assert [c.request_id for c in _run(scheduler)] == ["s1", "s2", "long", "s3"]
    assert scheduler.requests["long"].num_bypassed == 0


def test_without_a_limit_the_queue_is_first_come_first_served():
    scheduler = Scheduler(BlockManager(4, [64]), max_num_seqs=8, max_num_batched_tokens=64,
                          can_start=lambda r: r.request_id != "long")
    scheduler.add(_request("long", 20))
    scheduler.add(_request("s1", 3))
    assert _run(scheduler) == []
    with pytest.raises(ValueError, match="queue_bypass_limit"):
        Scheduler(BlockManager(4, [64]), max_num_seqs=8, max_num_batched_tokens=64, queue_bypass_limit=-1)


def test_decoding_split_requests_run_one_step_in_n_while_others_run():
    """"a" decodes with its oldest block lent to pool 1: with an interval of 3 it joins every
    third step while "b" (all at home) runs every step; "c", a prompt being prefilled, is never
    held back. Once "a" is alone, it runs every step."""
    block_manager = BlockManager(4, [64, 8])
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=16, split_decode_interval=3)
    scheduler.add(_request("a", 8))
    scheduler.add(_request("b", 3))
    assert [c.request_id for c in _run(scheduler)] == ["a", "b"]  # step 1: nothing split yet
    block_manager.commit_move(block_manager.lend("a", 1, 1, num_written=8))
    assert block_manager.is_split("a") and not block_manager.is_split("b")
    assert [[c.request_id for c in _run(scheduler)] for _ in range(4)] == [["b"], ["a", "b"], ["b"], ["b"]]
    scheduler.finish("b")
    assert [[c.request_id for c in _run(scheduler)] for _ in range(2)] == [["a"], ["a"]]
    with pytest.raises(ValueError, match="split_decode_interval"):
        Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=16, split_decode_interval=0)


def test_a_split_prompt_being_prefilled_is_never_held_back():
    block_manager = BlockManager(4, [64, 8])
    scheduler = Scheduler(block_manager, max_num_seqs=4, max_num_batched_tokens=8, split_decode_interval=3)
    scheduler.add(_request("c", 30))
    scheduler.add(_request("b", 3))
    assert [(c.request_id, c.num_tokens) for c in _run(scheduler)] == [("c", 8)]
    block_manager.commit_move(block_manager.lend("c", 1, 1, num_written=8))
    assert block_manager.is_split("c")
    assert [[c.request_id for c in _run(scheduler)] for _ in range(2)] == [["c"], ["c"]]


def test_a_first_chunk_larger_than_the_home_pool_starts_on_what_the_pool_holds():
    """Alone, a prompt whose first chunk needs more blocks than the home pool has starts on the
    part that fits; the rest follows once its written blocks are lent out."""
    bm = BlockManager(4, [2, 64])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add(_request("a", 12))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 8, False)]
    bm.commit_move(bm.lend("a", 2, 1, num_written=8))
    assert _run(scheduler) == [ScheduledChunk("a", 8, 4, True)]


def test_a_large_first_chunk_waits_while_others_hold_the_home_pool():
    bm = BlockManager(4, [3, 64])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add(_request("a", 2))
    scheduler.add(_request("b", 16))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 2, True)]  # b's 4 blocks are more than the 2 free
    assert scheduler.requests["b"].status is RequestStatus.WAITING
    scheduler.finish("a")
    assert _run(scheduler) == [ScheduledChunk("b", 0, 12, False)]


def test_the_newest_request_takes_the_part_of_its_chunk_that_fits_rather_than_preempt_itself():
    bm = BlockManager(4, [6, 64])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16)
    scheduler.add(_request("a", 4))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 4, True)]
    scheduler.add(_request("b", 20))
    assert _run(scheduler) == [ScheduledChunk("a", 4, 1, True), ScheduledChunk("b", 0, 15, False)]
    assert bm.num_free_blocks(0) == 0
    out = scheduler.schedule()  # b's next 5 tokens: 1 slot left in its tail, no block free
    assert out.preempted == ()
    assert out.chunks == (ScheduledChunk("a", 5, 1, True), ScheduledChunk("b", 15, 1, False))


def test_a_request_that_preempts_itself_restarts_in_the_same_step():
    """Alone and with not one free slot, a request gives its blocks back; the step then admits
    it again from the start instead of coming out empty."""
    bm = BlockManager(2, [3])
    scheduler = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.add(_request("a", 6))
    assert _run(scheduler) == [ScheduledChunk("a", 0, 6, True)]
    out = scheduler.schedule()
    assert out.preempted == ("a",)
    assert out.chunks == (ScheduledChunk("a", 0, 6, False),)  # 7 tokens now: 6 fit


def test_held_back_split_decodes_run_when_the_others_get_nothing():
    """With an interval of 2, "a" (split) is held back in odd steps; when "b", the only other
    request, preempts itself, "a" runs rather than leave the step empty."""
    bm = BlockManager(2, [3, 8])
    scheduler = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=5, split_decode_interval=2)
    scheduler.add(Request("a", [1, 2, 3, 4], SamplingParams(max_tokens=50)))
    scheduler.add(Request("b", [5], SamplingParams(max_tokens=50)))
    _run(scheduler)
    bm.commit_move(bm.lend("a", 2, 1, num_written=4))
    for _ in range(20):
        out = scheduler.schedule()
        assert not out.is_empty
        for chunk in out.chunks:
            request = scheduler.requests[chunk.request_id]
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if chunk.samples:
                request.output_token_ids.append(7)
        if out.preempted:
            assert [c.request_id for c in out.chunks] == ["a"]
            return
    raise AssertionError("b never preempted itself")


def test_token_ids_between_reads_prompt_and_output_as_one_sequence():
    request = Request("r", [10, 11, 12, 13], SamplingParams(max_tokens=8), output_token_ids=[20, 21, 22])
    whole = request.all_token_ids
    for start in range(len(whole) + 1):
        for end in range(start, len(whole) + 1):
            assert request.token_ids_between(start, end) == whole[start:end], (start, end)
