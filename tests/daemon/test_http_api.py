"""The OpenAI-compatible routes against a service that generates scripted events (no engine)."""

from __future__ import annotations

import asyncio

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

    async def generate(self, prompt, messages, params):
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
