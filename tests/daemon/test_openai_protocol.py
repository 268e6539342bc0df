import pytest

from infinite_llm.daemon.openai_protocol import (
    OpenAIError,
    chat_chunk,
    completion_response,
    parse_chat_request,
    parse_completion_request,
    parse_messages,
    parse_prompt,
)

MODEL = "smollm2-135m-instruct"


def test_completion_request_maps_to_sampling_params() -> None:
    req = parse_completion_request(
        {"model": MODEL, "prompt": "Hi", "max_tokens": 5, "temperature": 0, "stop": ["\n"], "seed": 7, "top_k": 3},
        MODEL,
    )
    assert req.prompt == "Hi" and req.messages is None and not req.stream
    assert (req.params.max_tokens, req.params.temperature, req.params.stop, req.params.seed, req.params.top_k) == (
        5, 0.0, ("\n",), 7, 3)


def test_token_id_prompt_and_chat_content_parts() -> None:
    assert parse_completion_request({"model": MODEL, "prompt": [1, 2, 3]}, MODEL).prompt == (1, 2, 3)
    req = parse_chat_request(
        {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
         "max_completion_tokens": 9, "stream": True, "stream_options": {"include_usage": True}},
        MODEL,
    )
    assert req.messages == ({"role": "user", "content": "a\nb"},)
    assert req.params.max_tokens == 9 and req.stream and req.include_usage


@pytest.mark.parametrize(
    ("body", "status", "param", "message"),
    [
        ([], 400, None, "must be a JSON object"),
        ({"model": MODEL, "prompt": "x", "temprature": 1}, 400, "temprature", "Unrecognized request argument supplied: temprature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens", "max_tokens must be an integer >= 1"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 1.5}, 400, "max_tokens", "must be an integer"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", "must not be empty"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
        ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n", "only n = 1"),
        ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature", r"temperature must be a number in \[0.0, 2.0\]"),
        ({"model": MODEL, "prompt": "x", "stop": [1]}, 400, "stop", "stop must be"),
        ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream", "stream must be a boolean"),
        # SamplingParams' own refusals name their parameter too
        ({"model": MODEL, "prompt": "x", "stop": ""}, 400, "stop", "stop must"),
        ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options", "only allowed with stream"),
        ({"model": "gpt-4", "prompt": "x"}, 404, "model", "does not exist"),
        ({"model": "", "prompt": "x"}, 400, "model", "model must be a non-empty string"),
        ({"model": MODEL, "prompt": "x", "seed": -(1 << 63) - 1}, 400, "seed", "seed must be an integer"),
        ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k", "top_k must be an integer >= -1"),
        ({"model": MODEL, "prompt": "x", "stop": ["s"] * 65}, 400, "stop", "at most 64"),
        ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs", "not supported"),
        # 0 asks for the sampled token's logprob (vLLM), not for none
        ({"model": MODEL, "prompt": "x", "logprobs": 0}, 400, "logprobs", "not supported"),
    ],
)
def test_bad_completion_requests(body, status, param, message) -> None:
    with pytest.raises(OpenAIError, match=message) as info:
        parse_completion_request(body, MODEL)
    assert info.value.status == status and info.value.param == param
    assert info.value.body()["error"]["message"] == str(info.value)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"model": MODEL, "messages": []}, "messages must be a non-empty list"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "role must be one of"),
        ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, "content must be a string"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text parts"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []}, "Unrecognized request argument supplied: tools"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs is not supported"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs is not supported"),
    ],
)
def test_bad_chat_requests(body, message) -> None:
    with pytest.raises(OpenAIError, match=message):
        parse_chat_request(body, MODEL)


def test_logprobs_turned_off_are_accepted() -> None:
    parse_completion_request({"model": MODEL, "prompt": "x", "logprobs": None}, MODEL)
    parse_chat_request({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": False,
                        "top_logprobs": 0}, MODEL)


@pytest.mark.parametrize("prompt", [5, "", [], [1, "2"], [True], [-1], {"text": "x"}, None])
def test_a_local_prompt_that_is_neither_text_nor_token_ids_is_refused(prompt) -> None:
    with pytest.raises(OpenAIError, match="prompt must be") as info:
        parse_prompt(prompt)
    assert info.value.status == 400


@pytest.mark.parametrize("messages", [[5], [{"role": "user"}], [{"content": "x"}], "hi", []])
def test_local_messages_are_checked_as_chat_messages(messages) -> None:
    with pytest.raises(OpenAIError):
        parse_messages(messages)


def test_response_bodies() -> None:
    body = completion_response("cmpl-1", MODEL, "hello", "stop", 3, 2)
    assert body["choices"][0]["text"] == "hello"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    chunk = chat_chunk("chatcmpl-1", MODEL, {"content": "he"}, None)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "he"}


def test_what_vllm_clients_send_is_taken_as_vllm_takes_it() -> None:
    """No model (the one served), top_k -1 (off), a negative seed, the developer role (the system
    role), an assistant turn with null content, more than OpenAI's four stop strings."""
    req = parse_completion_request({"prompt": "x", "top_k": -1, "seed": -5, "stop": ["a"] * 8}, MODEL)
    assert req.model == MODEL and req.params.top_k == 0 and req.params.seed == -5 and len(req.params.stop) == 8
    req = parse_chat_request({"messages": [{"role": "developer", "content": "be brief"},
                                           {"role": "user", "content": "hi"},
                                           {"role": "assistant", "content": None},
                                           {"role": "user", "content": "and?"}]}, MODEL)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "user"]
    assert req.messages[2]["content"] == ""
    with pytest.raises(OpenAIError, match="content must be a string"):
        parse_chat_request({"messages": [{"role": "user", "content": None}]}, MODEL)


def test_a_null_stream_is_no_stream_and_both_output_limits_are_checked() -> None:
    req = parse_completion_request({"model": MODEL, "prompt": "x", "stream": None}, MODEL)
    assert not req.stream
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    assert parse_chat_request({**chat, "max_completion_tokens": 5, "max_tokens": 9}, MODEL).params.max_tokens == 5
    with pytest.raises(OpenAIError, match="max_tokens must be") as info:
        parse_chat_request({**chat, "max_completion_tokens": 5, "max_tokens": "abc"}, MODEL)
    assert info.value.param == "max_tokens"
