"""OpenAI-compatible requests and responses: validation and response bodies, no I/O.

The HTTP server (``http_api.py``) calls :func:`parse_completion_request` or
:func:`parse_chat_request`, runs the engine, and renders with the ``*_response`` and ``*_chunk``
functions. Errors carry the status code and the body OpenAI clients expect:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Mapping

from infinite_llm.engine.sampling import SEED_MIN, SamplingParams

from .apb_plan import PREFILL_MODES, SCORERS, PrefillOptions

_COMMON_FIELDS = {
    "model", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stream_options",
    "stop", "seed", "user", "presence_penalty", "frequency_penalty", "ignore_eos",
}
# Infinite-LLM's own: how the prompt is prefilled (docs/apb.md), as extra body fields.
_PREFILL_FIELDS = {"prefill", "apb_hosts", "apb_anchor_tokens", "apb_passing_tokens", "apb_scorer"}
_COMPLETION_FIELDS = _COMMON_FIELDS | _PREFILL_FIELDS | {"prompt", "query", "echo", "logprobs", "suffix", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | _PREFILL_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}
_ROLES = ("system", "user", "assistant")
# OpenAI's newer name for the system role; chat templates know only "system".
_ROLE_ALIASES = {"developer": "system"}
DEFAULT_MAX_TOKENS = 256
# Stop strings a request may give: OpenAI allows 4, vLLM any number; each is looked for in the
# text after every token.
MAX_STOP_STRINGS = 64


class OpenAIError(Exception):
    """A request the API refuses, with its HTTP status and OpenAI error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 error_type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.error_type = error_type
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.error_type, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class GenerationRequest:
    """A validated completion or chat request."""

    model: str
    prompt: str | tuple[int, ...] | None  # completions
    messages: tuple[dict[str, str], ...] | None  # chat
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with token counts
    # The client set max_tokens (or max_completion_tokens): a prompt with that many tokens more
    # than the context is refused, as vLLM does, rather than cut short at the context's end.
    max_tokens_given: bool = False
    prefill: PrefillOptions = PrefillOptions()


def _require_object(body: object) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise OpenAIError("the request body must be a JSON object")
    return body


def _check_fields(body: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise OpenAIError(f"Unrecognized request argument supplied: {unknown[0]}", param=unknown[0])


def _number(body: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise OpenAIError(f"{name} must be a number in [{low}, {high}], got {value!r}", param=name)
    return float(value)


def _integer(body: Mapping[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise OpenAIError(f"{name} must be an integer >= {low}, got {value!r}", param=name)
    return value


# SamplingParams' own checks: their messages begin with the parameter's name.
_SAMPLING_PARAMS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos"})


def _sampling_params(body: Mapping[str, Any], max_tokens: int | None) -> SamplingParams:
    n = _integer(body, "n", 1, 1)
    if n != 1:
        raise OpenAIError("only n = 1 is supported", param="n")
    if body.get("best_of") not in (None, 1):
        raise OpenAIError("only best_of = 1 is supported", param="best_of")
    for name in ("presence_penalty", "frequency_penalty"):
        if _number(body, name, 0.0, -2.0, 2.0) != 0.0:
            raise OpenAIError(f"{name} is not supported (it must be 0)", param=name)
    # logprobs: a count on /v1/completions, where 0 asks for the sampled token's logprob (as
    # vLLM reads it), and a flag on chat; top_logprobs 0 asks for nothing. (0 == False in
    # Python: the flag is told apart by identity.)
    logprobs = body.get("logprobs")
    if not (logprobs is None or logprobs is False):
        raise OpenAIError("logprobs is not supported", param="logprobs")
    if body.get("top_logprobs") not in (None, 0):
        raise OpenAIError("top_logprobs is not supported", param="top_logprobs")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and len(stop) <= MAX_STOP_STRINGS and all(isinstance(s, str) and s for s in stop):
        stop = tuple(stop)
    else:
        raise OpenAIError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                          param="stop")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise OpenAIError("ignore_eos must be a boolean", param="ignore_eos")
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else DEFAULT_MAX_TOKENS,
            temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
            top_p=_number(body, "top_p", 1.0, 0.0, 1.0) or 1e-9,
            top_k=max(0, _integer(body, "top_k", 0, -1)),  # -1: off, as in vLLM
            seed=_integer(body, "seed", None, SEED_MIN),
            stop=stop,
            ignore_eos=ignore_eos,
        )
    except ValueError as exc:
        name = str(exc).split(" ", 1)[0]
        raise OpenAIError(str(exc), param=name if name in _SAMPLING_PARAMS else None) from None



def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is None:  # null is the API's default, false
        stream = False
    if not isinstance(stream, bool):
        raise OpenAIError("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise OpenAIError("stream_options is only allowed with stream = true", param="stream_options")
        if not isinstance(options, Mapping) or set(options) - {"include_usage"}:
            raise OpenAIError("stream_options must be an object with include_usage", param="stream_options")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise OpenAIError("stream_options.include_usage must be a boolean", param="stream_options")
    return stream, include_usage


def _model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if model is None:  # as in vLLM: the one model served
        return served_model
    if not isinstance(model, str) or not model:
        raise OpenAIError("model must be a non-empty string", param="model")
    if model != served_model:
        raise OpenAIError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")
    return model


def parse_completion_request(body: object, served_model: str) -> GenerationRequest:
    """Validate a ``/v1/completions`` body; raises :class:`OpenAIError`."""
    body = _require_object(body)
    _check_fields(body, _COMPLETION_FIELDS)
    model = _model(body, served_model)
    if body.get("echo") not in (None, False):
        raise OpenAIError("echo is not supported", param="echo")
    if body.get("suffix") is not None:
        raise OpenAIError("suffix is not supported", param="suffix")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise OpenAIError("prompt must not be empty", param="prompt")
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        prompt = tuple(prompt)
    else:
        raise OpenAIError("prompt must be a non-empty string or a list of token ids (one prompt per request)", param="prompt")
    max_tokens = _integer(body, "max_tokens", None, 1)
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(model, prompt, None, _sampling_params(body, max_tokens), stream, include_usage,
                             max_tokens_given=max_tokens is not None, prefill=parse_prefill(body, chat=False))


def parse_chat_request(body: object, served_model: str) -> GenerationRequest:
    """Validate a ``/v1/chat/completions`` body; raises :class:`OpenAIError`."""
    body = _require_object(body)
    _check_fields(body, _CHAT_FIELDS)
    model = _model(body, served_model)
    parsed = parse_messages(body.get("messages"))
    # Both are checked; max_completion_tokens, the newer name, wins where both are given.
    max_completion_tokens = _integer(body, "max_completion_tokens", None, 1)
    max_tokens = _integer(body, "max_tokens", None, 1)
    if max_completion_tokens is not None:
        max_tokens = max_completion_tokens
    stream, include_usage = _stream_flags(body)
    return GenerationRequest(model, None, parsed, _sampling_params(body, max_tokens), stream, include_usage,
                             max_tokens_given=max_tokens is not None, prefill=parse_prefill(body, chat=True))


def parse_prefill(body: Mapping[str, Any], chat: bool) -> PrefillOptions:
    """The prefill fields of a completion or chat body; raises :class:`OpenAIError`.

    ``prefill``: "exact" (default) or "apb"; ``query`` (completions): the question after the
    document, a string or token ids (a chat's query is its last user turn); ``apb_hosts``,
    ``apb_anchor_tokens``, ``apb_passing_tokens``, ``apb_scorer``: APB's settings."""
    mode = body.get("prefill", "exact")
    if mode is None:
        mode = "exact"
    if mode not in PREFILL_MODES:
        raise OpenAIError(f"prefill must be one of {', '.join(PREFILL_MODES)}", param="prefill")
    query = body.get("query") if not chat else None
    if query is not None:
        if isinstance(query, str):
            if not query:
                raise OpenAIError("query must not be empty", param="query")
        elif isinstance(query, list) and query and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in query):
            query = tuple(query)
        else:
            raise OpenAIError("query must be a non-empty string or a list of token ids", param="query")
    values = {}
    for name in ("apb_hosts", "apb_anchor_tokens", "apb_passing_tokens"):
        values[name] = _integer(body, name, None, 1 if name == "apb_hosts" else 0)
    scorer = body.get("apb_scorer")
    scorer = "attention" if scorer is None else scorer
    if scorer not in SCORERS:
        raise OpenAIError(f"apb_scorer must be one of {', '.join(SCORERS)}", param="apb_scorer")
    return PrefillOptions(mode, query, values["apb_hosts"], values["apb_anchor_tokens"], values["apb_passing_tokens"],
                          scorer)


def parse_messages(messages: object) -> tuple[dict[str, str], ...]:
    """Chat messages as ``{"role", "content"}`` with string content; raises :class:`OpenAIError`."""
    if not isinstance(messages, list) or not messages:
        raise OpenAIError("messages must be a non-empty list", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        role = message.get("role") if isinstance(message, Mapping) else None
        role = _ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in _ROLES:
            raise OpenAIError(f"messages[{i}].role must be one of {', '.join(_ROLES + tuple(_ROLE_ALIASES))}",
                              param=f"messages[{i}].role")
        content = message.get("content")
        if content is None and role == "assistant":  # OpenAI's form of an assistant turn without text
            content = ""
        if isinstance(content, list):
            # The content-parts form: text parts only, one line each (as vLLM joins them).
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported", param=f"messages[{i}].content")
            content = "\n".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise OpenAIError(f"messages[{i}].content must be a string", param=f"messages[{i}].content")
        parsed.append({"role": role, "content": content})
    return tuple(parsed)


def parse_prompt(prompt: object) -> str | tuple[int, ...]:
    """A prompt: a non-empty string or a non-empty list of token ids; raises :class:`OpenAIError`."""
    if isinstance(prompt, str) and prompt:
        return prompt
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)):
        return tuple(prompt)
    raise OpenAIError("prompt must be a non-empty string or a non-empty list of token ids", param="prompt")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def completion_chunk(request_id: str, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
    }


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None,
                  prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": usage(prompt_tokens, completion_tokens),
    }


def chat_chunk(request_id: str, model: str, delta: Mapping[str, str], finish_reason: str | None) -> dict[str, Any]:
    return {
        "id": request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish_reason}],
    }


def usage_chunk(request_id: str, model: str, obj: str, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """The last streamed chunk when ``stream_options.include_usage`` is set: no choices."""
    return {"id": request_id, "object": obj, "created": int(time.time()), "model": model, "choices": [],
            "usage": usage(prompt_tokens, completion_tokens)}
