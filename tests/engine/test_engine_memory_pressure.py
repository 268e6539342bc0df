"""Small pools: requests that must recompute, spill or start on part of a chunk still finish,
with the tokens they get alone, and free every block."""

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams


def _alone(smollm2, prompt, params):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,), max_num_batched_tokens=64))
    return engine.generate([prompt], params)[0].token_ids


def _generate(engine: LLMEngine, prompts, params, max_steps: int) -> list[tuple[int, ...]]:
    """Like ``engine.generate``, but fails after ``max_steps`` steps instead of stepping forever."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens = {}
    for _ in range(max_steps):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            tokens[output.request_id] = output.token_ids
    else:
        raise AssertionError(f"unfinished after {max_steps} steps (request, preemptions): "
                             f"{[(r.request_id, r.num_preemptions) for r in engine.scheduler.requests.values()]}")
    assert all(engine.block_manager.num_free_blocks(i) == n for i, n in enumerate(engine.config.pool_blocks))
    return [tokens[i] for i in ids]


def test_a_request_preempted_after_its_prompt_recomputes_its_outputs_and_finishes(smollm2, prompt_token_ids):
    """The second request is preempted once it has outputs; recomputing prompt and outputs, it
    needs a chunk's room at home past its prompt, which the spill must make as for a prompt."""
    document = prompt_token_ids[4]
    prompts = [document[:4], document[20:27]]
    params = [SamplingParams(max_tokens=20, ignore_eos=True), SamplingParams(max_tokens=16, ignore_eos=True)]
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(3, 7), max_num_seqs=3,
                                             max_num_batched_tokens=12))
    tokens = _generate(engine, prompts, params, max_steps=60)
    assert tokens == [_alone(smollm2, p, sp) for p, sp in zip(prompts, params)]


def test_a_lone_request_spills_to_several_creditors(smollm2, prompt_token_ids):
    """7 blocks of KV, a home of 4 and two creditors of 2: no creditor alone makes the room."""
    prompt = prompt_token_ids[4][:26]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(4, 2, 2), max_num_batched_tokens=16))
    assert _generate(engine, [prompt], [params], max_steps=12) == [_alone(smollm2, prompt, params)]


def test_a_first_chunk_larger_than_the_home_pool_runs_and_does_not_block_the_queue(smollm2, prompt_token_ids):
    prompts = [prompt_token_ids[4][:300], prompt_token_ids[0]]
    params = [SamplingParams(max_tokens=4, ignore_eos=True)] * 2
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(16, 64)))  # a 512-token chunk; 256 home slots
    tokens = _generate(engine, prompts, params, max_steps=20)
    assert tokens == [_alone(smollm2, p, sp) for p, sp in zip(prompts, params)]


def test_split_decodes_held_back_run_when_the_other_request_preempts_itself(smollm2, prompt_token_ids):
    prompts = [prompt_token_ids[3][:6], prompt_token_ids[3][:3]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True), SamplingParams(max_tokens=7, ignore_eos=True)]
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(4, 1), max_num_seqs=3,
                                             max_num_batched_tokens=12, split_decode_interval=2))
    tokens = _generate(engine, prompts, params, max_steps=40)
    assert tokens == [_alone(smollm2, p, sp) for p, sp in zip(prompts, params)]


class _LenderKeepingNothing:
    """A lender whose peers keep no blocks for any request (home_blocks_promised's inputs)."""

    def blocks_kept_elsewhere(self, request_id: str, wanted: int) -> int:
        return 0


def test_a_recompute_past_the_prompt_counts_as_a_prefill_in_the_home_blocks_wanted(smollm2, prompt_token_ids):
    """A preempted request recomputes its prompt and outputs in chunks: past its prompt it still
    wants a chunk's room at home, and still counts on the home blocks its known tokens need."""
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(16, 8), max_num_batched_tokens=12))
    request_id = engine.add_request(prompt_token_ids[3][:7], SamplingParams(max_tokens=20, ignore_eos=True))
    for _ in range(8):  # the prompt, then 7 decodes: 15 tokens, 14 written
        engine.step()
    request = engine.scheduler.requests[request_id]
    engine.scheduler._preempt(request)
    engine.step()  # the recompute's first chunk: 12 of the 15 tokens, past the 7 of the prompt
    assert (request.num_tokens, request.num_computed_tokens) == (15, 12)
    chunk_blocks = 12 // 4
    assert engine.home_blocks_wanted() == 1 + 1 + chunk_blocks
    engine.lender = _LenderKeepingNothing()  # the promise counts only with peers
    assert engine.home_blocks_promised() == 1  # tokens 12..14: one block past the 3 it holds
