"""Continuous batching: requests joining, sampling with a seed, stop conditions, streaming."""

import pytest

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine, RequestRejected
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


def test_an_aborted_stream_ends_with_its_last_output(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(64,)))
    stream = engine.stream("The capital of France is", SamplingParams(max_tokens=20, ignore_eos=True))
    first = next(stream)
    assert engine.abort(first.request_id).finish_reason == "abort"
    rest = list(stream)  # ends: no step of the engine makes more of an aborted request
    assert [(o.finished, o.finish_reason, o.token_ids) for o in rest] == [(True, "abort", first.token_ids)]
    assert rest[0].text == first.text
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks(0) == 64
    assert engine.abort(first.request_id) is None  # no longer here


def test_two_streams_read_in_turn_each_get_all_their_outputs(smollm2):
    """Each stream steps the engine for both requests: the other one's outputs wait for it."""
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(64,)))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    alone = [engine.generate([p], params)[0].token_ids for p in ("One, two,", "Red, green,")]
    streams = [engine.stream(p, params) for p in ("One, two,", "Red, green,")]
    seen: list[list] = [[], []]
    for a, b in zip(*streams):
        seen[0].append(a)
        seen[1].append(b)
    for outputs, expected in zip(seen, alone):
        assert [o.num_output_tokens for o in outputs] == [1, 2, 3, 4, 5, 6]
        assert tuple(t for o in outputs for t in o.new_token_ids) == expected
        assert outputs[-1].finished and outputs[-1].token_ids == expected
        assert "".join(o.new_text for o in outputs) == outputs[-1].text


def test_a_refused_prompt_or_a_stream_left_early_leaves_no_request_behind(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(64,)))
    with pytest.raises(RequestRejected, match="empty"):
        engine.generate(["The capital of France is", ""], SamplingParams(max_tokens=4))
    assert not engine.has_unfinished
    stream = engine.stream("The capital of France is", SamplingParams(max_tokens=20, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks(0) == 64


def test_an_output_kept_from_an_earlier_step_reads_as_it_was_then(smollm2):
    """An output's token_ids and text are made when read, from lists that grow after it:
    they still say what was made up to its step."""
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(64,)))
    outputs = list(engine.stream("The capital of France is", SamplingParams(max_tokens=8, ignore_eos=True)))
    for i, output in enumerate(outputs):
        assert output.token_ids == tuple(t for o in outputs[:i + 1] for t in o.new_token_ids)
        assert output.text == "".join(o.new_text for o in outputs[:i + 1])
