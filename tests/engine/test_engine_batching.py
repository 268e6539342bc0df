"""Continuous batching: requests joining, sampling with a seed, stop conditions, streaming."""

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams


def _alone(smollm2, prompt, params):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,), max_num_batched_tokens=64))
    return engine.generate([prompt], params)[0]


def test_requests_arriving_while_others_decode_get_the_tokens_they_get_alone(smollm2, prompt_token_ids):
    prompts = [prompt_token_ids[0], prompt_token_ids[1], prompt_token_ids[4][:150], prompt_token_ids[3]]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=40, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=1.2, seed=3, ignore_eos=True),
    ]
    expected = [_alone(smollm2, p, sp).token_ids for p, sp in zip(prompts, params)]
    # A 32-token budget makes the 150-token prompt prefill in chunks between decode steps.
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,), max_num_batched_tokens=32))
    arrivals = {0: [0], 2: [1], 4: [2], 5: [3]}
    ids = {}
    final = {}
    step = 0
    while step in arrivals or engine.has_unfinished or step <= max(arrivals):
        for index in arrivals.get(step, []):
            ids[engine.add_request(prompts[index], params[index])] = index
        for output in engine.step():
            if output.finished:
                final[ids[output.request_id]] = output.token_ids
        step += 1
    assert [final[i] for i in range(len(prompts))] == expected


def test_preempted_request_recomputes_without_disturbing_others(smollm2, prompt_token_ids):
    prompts = [prompt_token_ids[0], prompt_token_ids[2], prompt_token_ids[3]]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = [_alone(smollm2, p, params).token_ids for p in prompts]
    # 10 blocks of 4 tokens cannot hold three growing requests: the newest is preempted.
    engine = LLMEngine(smollm2, EngineConfig(block_size=4, pool_blocks=(12,), max_num_batched_tokens=64))
    outputs = engine.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert engine.scheduler.requests == {}
    assert engine.block_manager.num_free_blocks(0) == 12


def test_stop_string_cuts_the_text_and_streaming_adds_up(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,)))
    full = engine.generate(["The capital of France is"], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert "\n" in full.text
    stop_at = full.text.index("\n")
    streamed = list(engine.stream("The capital of France is", SamplingParams(max_tokens=20, stop=("\n",))))
    assert streamed[-1].finished and streamed[-1].finish_reason == "stop"
    assert streamed[-1].text == full.text[:stop_at]
    assert "".join(o.new_text for o in streamed) == full.text[:stop_at]
    assert len(streamed) >= 2  # tokens came one at a time


def test_max_tokens_and_stop_token_ids(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,)))
    first = engine.generate(["List three colours of the rainbow:"], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(first.token_ids) == 5 and first.finish_reason == "length"
    stopped = engine.generate(["List three colours of the rainbow:"],
                              SamplingParams(max_tokens=5, stop_token_ids=(first.token_ids[2],)))[0]
    assert stopped.token_ids == first.token_ids[:3] and stopped.finish_reason == "stop"


def test_chat_messages_use_the_checkpoint_template(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(256,)))
    output = engine.generate([[{"role": "user", "content": "What is 2+2?"}]], SamplingParams(max_tokens=30))[0]
    assert output.finish_reason == "stop"  # the model closes its turn with <|im_end|>
    assert "4" in output.text
