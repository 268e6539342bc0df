"""The OpenAI-compatible routes against a service that generates scripted events (no engine)."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp.test_utils import TestClient, TestServer

from infinite_llm.daemon.http_api import GenerationEvent, OpenAIApp
from infinite_llm.daemon.metrics import InstanceMetrics

MODEL = "scripted"


class ScriptedService:
    """Generates the given events for every request."""

    served_model = MODEL

    def __init__(self, events: list[GenerationEvent]) -> None:
        self.events = events
        self.metrics = InstanceMetrics()

    async def generate(self, prompt, messages, params, refuse_past_context=False, prefill=None):
        for event in self.events:
            await asyncio.sleep(0)
            yield event


def post(events: list[GenerationEvent], path: str, body: dict) -> tuple[int, dict]:
    async def scenario() -> tuple[int, dict]:
        async with TestClient(TestServer(OpenAIApp(ScriptedService(events)).build())) as client:
            response = await client.post(path, json=body)
            return response.status, await response.json()
    return asyncio.run(scenario())


def test_a_request_that_fails_midway_is_a_server_error_not_a_cut_off_text():
    events = [GenerationEvent("1", "Once", (5,), False, None, 3, 1),
              GenerationEvent("1", "", (), True, "error", 3, 1)]
    status, body = post(events, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 8})
    assert status == 500 and body["error"]["type"] == "server_error" and "after 1 tokens" in body["error"]["message"]
    status, body = post(events, "/v1/chat/completions",
                        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8})
    assert status == 500 and body["error"]["type"] == "server_error"


def test_a_request_that_ends_is_answered_whole():
    events = [GenerationEvent("1", "Once", (5,), False, None, 3, 1),
              GenerationEvent("1", " upon", (6,), True, "length", 3, 2)]
    status, body = post(events, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2})
    assert status == 200 and body["choices"][0]["text"] == "Once upon"
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 2


def test_a_stream_that_fails_midway_ends_with_an_error_event_the_openai_client_raises():
    """Not a chunk with a finish reason the client does not know (it would end the stream as if
    the text were whole): an error event, on which the openai client raises."""
    import openai

    events = [GenerationEvent("1", "Once", (5,), False, None, 3, 1),
              GenerationEvent("1", "", (), True, "error", 3, 1)]

    async def scenario() -> tuple[list[bytes], list[str], Exception | None]:
        async with TestClient(TestServer(OpenAIApp(ScriptedService(events)).build())) as client:
            response = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True,
                "stream_options": {"include_usage": True}})
            lines = [line for line in (await response.read()).split(b"\n\n") if line]
            api = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="none", max_retries=0)
            texts, raised = [], None
            try:
                stream = await api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                           stream=True)
                async for chunk in stream:
                    texts.extend(c.delta.content or "" for c in chunk.choices)
            except openai.APIError as exc:
                raised = exc
            return lines, texts, raised

    lines, texts, raised = asyncio.run(scenario())
    assert lines[-1] == b"data: [DONE]"
    error = orjson.loads(lines[-2].removeprefix(b"data: "))
    assert error["error"]["type"] == "server_error" and "after 1 tokens" in error["error"]["message"]
    assert not any(b'"finish_reason":"error"' in line or b'"usage"' in line for line in lines)
    assert texts == ["", "Once"] and raised is not None and "after 1 tokens" in str(raised)


def test_the_servers_own_refusals_come_in_openai_error_bodies():
    """No such route, a wrong method and a body over the limit: JSON error bodies with their
    status, as the routes' own errors are, not aiohttp's plain text."""
    async def scenario() -> list[tuple[int, dict, str | None]]:
        async with TestClient(TestServer(OpenAIApp(ScriptedService([])).build())) as client:
            answers = []
            for method, path, data in (("GET", "/v1/nothing", None), ("GET", "/v1/completions", None),
                                       ("POST", "/v1/completions", b"x" * ((16 << 20) + 1))):
                response = await client.request(method, path, data=data,
                                                headers={"Content-Type": "application/json"})
                answers.append((response.status, await response.json(), response.headers.get("Allow")))
            return answers

    (missing, missing_body, _), (wrong, wrong_body, allow), (large, large_body, _) = asyncio.run(scenario())
    assert missing == 404 and missing_body["error"]["type"] == "invalid_request_error"
    assert "/v1/nothing" in missing_body["error"]["message"]
    assert wrong == 405 and allow == "POST" and "GET /v1/completions" in wrong_body["error"]["message"]
    assert large == 413 and large_body["error"]["message"]


def test_a_body_whose_content_encoding_does_not_decode_is_a_bad_request():
    """aiohttp cannot decompress it: a 400 in OpenAI's error body, not a plain-text 500."""
    events = [GenerationEvent("1", "Once", (5,), True, "length", 3, 1)]

    async def scenario() -> list[tuple[int, dict]]:
        async with TestClient(TestServer(OpenAIApp(ScriptedService(events)).build())) as client:
            answers = []
            for encoding in ("gzip", "deflate"):
                response = await client.post("/v1/completions", data=b"not compressed at all",
                                             headers={"Content-Encoding": encoding, "Content-Type": "application/json",
                                                      # the server closes a connection whose body broke
                                                      "Connection": "close"})
                answers.append((response.status, await response.json()))
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1})
            answers.append((response.status, await response.json()))
            return answers

    (gzip_status, gzip_body), (deflate_status, deflate_body), (status, body) = asyncio.run(scenario())
    for code, error in ((gzip_status, gzip_body), (deflate_status, deflate_body)):
        assert code == 400 and error["error"]["type"] == "invalid_request_error"
        assert "cannot be read" in error["error"]["message"]
    assert status == 200 and body["choices"][0]["text"] == "Once"
