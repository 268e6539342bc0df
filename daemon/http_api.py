"""The daemon's two HTTP faces (aiohttp).

* The local admin API on a Unix socket (mode 0660): ``GET /v1/status``, ``POST /v1/drain``,
  ``POST /v1/generate`` (NDJSON stream). The caller's uid comes from SO_PEERCRED; mutations
  need root, the daemon's own user, or the admin group (else 403).
* The OpenAI-compatible API on TCP: ``/v1/models``, ``/v1/completions``,
  ``/v1/chat/completions`` (SSE streaming or not), ``/metrics``, ``/health``.

Both call an :class:`InstanceService`; this module does HTTP and nothing else.
"""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Mapping, Protocol

import orjson
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from infinite_llm.engine.sampling import SamplingParams

from .apb_plan import PrefillOptions
from .local_auth import PeerCredentials, may_mutate, peer_credentials
from .metrics import InstanceMetrics
from .openai_protocol import (
    GenerationRequest,
    OpenAIError,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    new_id,
    parse_chat_request,
    parse_completion_request,
    parse_messages,
    parse_prefill,
    parse_prompt,
    usage_chunk,
)

log = logging.getLogger(__name__)

_MAX_BODY_BYTES = 16 << 20


class RequestRefused(Exception):
    """The service will not take a request: bad input (400), or no capacity / draining (503)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class GenerationEvent:
    """One step's progress of one request."""

    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", or "error" (it failed here) once finished
    num_prompt_tokens: int
    num_output_tokens: int
    # On a request's first event: how its prompt was prefilled, where that is worth saying
    # (an APB prefill, or an asked-for APB prefill that fell back to exact); see docs/apb.md.
    prefill: dict[str, Any] | None = None


class InstanceService(Protocol):
    """What the HTTP layer needs from an instance."""

    served_model: str
    metrics: InstanceMetrics

    def generate(
        self, prompt: str | tuple[int, ...] | None, messages: tuple[dict[str, str], ...] | None,
        params: SamplingParams, refuse_past_context: bool = False, prefill: PrefillOptions | None = None,
    ) -> AsyncIterator[GenerationEvent]:
        """Stream a request's progress; raises :class:`RequestRefused` before the first event.
        ``refuse_past_context``: refuse a prompt whose tokens and ``params.max_tokens`` exceed
        the model's context (else the output ends at the context's end). ``prefill``: how to
        prefill it (None: exact)."""
        ...

    def status(self) -> dict[str, Any]: ...

    async def drain(self) -> dict[str, Any]: ...

    async def uncordon(self) -> dict[str, Any]: ...


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def _openai_error(error: OpenAIError) -> web.Response:
    return _json(error.body(), status=error.status)


async def _read_json(request: web.Request) -> Any:
    if request.content_length is not None and request.content_length > _MAX_BODY_BYTES:
        raise OpenAIError(f"the request body is larger than {_MAX_BODY_BYTES} bytes", status=413)
    try:
        raw = await request.read()
    except RequestPayloadError as exc:  # e.g. a body whose Content-Encoding does not decode
        raise OpenAIError(f"the request body cannot be read: {exc}") from None
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise OpenAIError(f"the request body is not valid JSON: {exc}") from None


async def _first_event(stream: AsyncIterator[GenerationEvent]) -> GenerationEvent:
    """Pull the first event so that a refusal becomes an HTTP error, not a broken stream."""
    try:
        return await anext(stream)
    except RequestRefused as exc:
        error_type = "invalid_request_error" if exc.status < 500 else "service_unavailable"
        raise OpenAIError(str(exc), status=exc.status, error_type=error_type) from None


async def _events(first: GenerationEvent, stream: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    yield first
    async for event in stream:
        yield event


@web.middleware
async def _openai_http_errors(request: web.Request, handler) -> web.StreamResponse:
    """aiohttp's own refusals (no such route, wrong method, a body over the limit) in OpenAI's
    error body, as every other error of this API is, rather than as plain text."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        error = OpenAIError(f"{exc.reason}: {request.method} {request.path}" if exc.status in (404, 405)
                            else exc.text or exc.reason, status=exc.status, error_type=kind)
        response = _json(error.body(), status=exc.status)
        if "Allow" in exc.headers:  # a 405 names the methods there are
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:  # noqa: BLE001  a bug's 500 still says what it was
        log.exception("%s %s failed", request.method, request.path)
        return _json(OpenAIError(f"internal error: {type(exc).__name__}: {exc}"[:2000], status=500,
                                 error_type="server_error").body(), status=500)


@web.middleware
async def _local_http_errors(request: web.Request, handler) -> web.StreamResponse:
    """An unexpected failure of a local API call as a JSON error naming it (and in the log),
    rather than aiohttp's plain-text 500."""
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except Exception as exc:  # noqa: BLE001
        log.exception("%s %s failed", request.method, request.path)
        return _json({"error": f"internal error: {type(exc).__name__}: {exc}"[:2000]}, status=500)


class OpenAIApp:
    """Routes of the OpenAI-compatible TCP API."""

    def __init__(self, service: InstanceService) -> None:
        self.service = service

    def build(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_openai_http_errors])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/health", self.health)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return _json({"object": "list", "data": [
            {"id": self.service.served_model, "object": "model", "created": 0, "owned_by": "infinite-llm"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.service.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            body = await _read_json(request)
            parse = parse_chat_request if chat else parse_completion_request
            req = parse(body, self.service.served_model)
            stream = self.service.generate(req.prompt, req.messages, req.params,
                                           refuse_past_context=req.max_tokens_given, prefill=req.prefill)
            first = await _first_event(stream)
        except OpenAIError as exc:
            return _openai_error(exc)
        events = _events(first, stream)
        if req.stream:
            try:
                return await self._stream(request, req, first, events, chat)
            finally:
                await stream.aclose()  # at once, not when the collector gets to it
        text, last = [], first
        try:
            async for event in events:
                text.append(event.new_text)
                last = event
        finally:
            await events.aclose()
            await stream.aclose()
        if last.finish_reason == "error":
            # OpenAI's clients retry a server error; a 200 with a finish reason they do not
            # know would hand them a cut-off text as if it were whole.
            return _openai_error(_failed_midway(last))
        render = chat_response if chat else completion_response
        rid = new_id("chatcmpl" if chat else "cmpl")
        body = render(rid, req.model, "".join(text), last.finish_reason, last.num_prompt_tokens, last.num_output_tokens)
        if first.prefill is not None:
            body["prefill"] = first.prefill
        return _json(body)

    async def _stream(self, request: web.Request, req: GenerationRequest, first: GenerationEvent,
                      events: AsyncIterator[GenerationEvent], chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        rid = new_id("chatcmpl" if chat else "cmpl")
        last = None
        prefill = None  # said once, in the first chunk
        try:
            await response.prepare(request)
            if chat:
                chunk = chat_chunk(rid, req.model, {"role": "assistant", "content": ""}, None)
                if first.prefill is not None:
                    chunk["prefill"] = first.prefill
                await _sse(response, chunk)
            else:
                prefill = first.prefill
            async for event in events:
                last = event
                if event.finish_reason == "error":
                    # An error event, not a chunk with a finish reason clients do not know: the
                    # openai client raises APIError on it rather than end the stream as if the
                    # text were whole. The text of this last event is left out with the rest.
                    await _sse(response, _failed_midway(event).body())
                    break
                if event.new_text or event.finished:
                    if chat:
                        delta = {"content": event.new_text} if event.new_text else {}
                        chunk = chat_chunk(rid, req.model, delta, event.finish_reason)
                    else:
                        chunk = completion_chunk(rid, req.model, event.new_text, event.finish_reason)
                        if prefill is not None:
                            chunk["prefill"], prefill = prefill, None
                    await _sse(response, chunk)
            if req.include_usage and last is not None and last.finish_reason != "error":
                obj = "chat.completion.chunk" if chat else "text_completion"
                await _sse(response, usage_chunk(rid, req.model, obj, last.num_prompt_tokens, last.num_output_tokens))
            await response.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            log.info("completion stream: the client went away; its request is cancelled")
        finally:
            # A client that went away ends the generator, which aborts the request in the engine.
            await events.aclose()
        return response


def _failed_midway(last: GenerationEvent) -> OpenAIError:
    return OpenAIError(f"the request failed on this instance after {last.num_output_tokens} tokens (see its log); "
                       "it may be sent again", status=500, error_type="server_error")


async def _sse(response: web.StreamResponse, data: Mapping[str, Any]) -> None:
    await response.write(b"data: " + orjson.dumps(data) + b"\n\n")


class LocalApp:
    """Routes of the local admin API on the Unix socket."""

    def __init__(self, service: InstanceService, admin_gid: int | None) -> None:
        self.service = service
        self.admin_gid = admin_gid

    def build(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[_local_http_errors])
        app.router.add_get("/v1/status", self.status)
        app.router.add_post("/v1/drain", self.drain)
        app.router.add_post("/v1/uncordon", self.uncordon)
        app.router.add_post("/v1/generate", self.generate)
        return app

    def _caller(self, request: web.Request) -> PeerCredentials | None:
        sock = request.transport.get_extra_info("socket") if request.transport else None
        if sock is None:
            return None
        return peer_credentials(sock)

    def _forbidden(self, request: web.Request) -> web.Response | None:
        creds = self._caller(request)
        if creds is None or not may_mutate(creds, self.admin_gid):
            who = "unknown caller" if creds is None else f"uid {creds.uid}"
            return _json({"error": f"{who} may not change this instance: root or the admin group only"}, status=403)
        return None

    async def status(self, request: web.Request) -> web.Response:
        return _json(self.service.status())

    async def drain(self, request: web.Request) -> web.Response:
        if (refusal := self._forbidden(request)) is not None:
            return refusal
        # Shielded: a caller that goes away (its handler is cancelled) does not cut a drain short.
        return _json(await asyncio.shield(self.service.drain()))

    async def uncordon(self, request: web.Request) -> web.Response:
        if (refusal := self._forbidden(request)) is not None:
            return refusal
        try:
            return _json(await asyncio.shield(self.service.uncordon()))
        except RequestRefused as exc:
            return _json({"error": str(exc)}, status=exc.status)

    async def generate(self, request: web.Request) -> web.StreamResponse:
        if (refusal := self._forbidden(request)) is not None:
            return refusal
        try:
            body = await _read_json(request)
            if not isinstance(body, Mapping):
                raise OpenAIError("the request body must be a JSON object")
            unknown = sorted(set(body) - {"prompt", "messages", "params", "prefill"})
            if unknown:
                raise OpenAIError(f"unknown field: {unknown[0]}")
            prompt, messages = body.get("prompt"), body.get("messages")
            if (prompt is None) == (messages is None):
                raise OpenAIError("give exactly one of prompt and messages")
            if prompt is not None:
                prompt = parse_prompt(prompt)
            else:
                messages = parse_messages(messages)
            params_body = body.get("params", {})
            if not isinstance(params_body, Mapping):
                raise OpenAIError("params must be an object")
            try:
                params = SamplingParams(**params_body)
            except TypeError as exc:
                raise OpenAIError(f"params: {exc}") from None
            except ValueError as exc:
                raise OpenAIError(f"params: {exc}") from None
            prefill = parse_local_prefill(body.get("prefill"), chat=messages is not None)
            stream = self.service.generate(prompt, messages, params, prefill=prefill)
            first = await _first_event(stream)
        except OpenAIError as exc:
            return _json({"error": str(exc)}, status=exc.status)
        response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
        events = _events(first, stream)
        try:
            await response.prepare(request)
            async for event in events:
                line = {
                    "request_id": event.request_id, "text": event.new_text, "token_ids": list(event.new_token_ids),
                    "finished": event.finished, "finish_reason": event.finish_reason,
                    "prompt_tokens": event.num_prompt_tokens, "completion_tokens": event.num_output_tokens,
                }
                if event.prefill is not None:
                    line["prefill"] = event.prefill
                await response.write(orjson.dumps(line) + b"\n")
        except ConnectionResetError:  # the client left: closing the stream cancels its request
            log.info("generate: the client went away; its request is cancelled")
        finally:
            await events.aclose()
            await stream.aclose()
        return response


_LOCAL_PREFILL_FIELDS = {"mode": "prefill", "query": "query", "hosts": "apb_hosts", "anchor_tokens": "apb_anchor_tokens",
                         "passing_tokens": "apb_passing_tokens", "scorer": "apb_scorer"}


def parse_local_prefill(prefill: object, chat: bool) -> PrefillOptions:
    """The local API's ``prefill`` object (``{"mode", "query", "hosts", "anchor_tokens",
    "passing_tokens", "scorer"}``, every field optional; None: exact), checked as the OpenAI
    API's fields are; raises :class:`OpenAIError`."""
    if prefill is None:
        return PrefillOptions()
    if not isinstance(prefill, Mapping):
        raise OpenAIError("prefill must be an object: {\"mode\": \"apb\" | \"exact\", \"query\", \"hosts\", ...}")
    unknown = sorted(set(prefill) - set(_LOCAL_PREFILL_FIELDS))
    if unknown:
        raise OpenAIError(f"unknown prefill field: {unknown[0]}")
    if chat and prefill.get("query") is not None:
        raise OpenAIError("prefill.query is for a prompt: a chat's query is its last user turn")
    try:
        return parse_prefill({_LOCAL_PREFILL_FIELDS[k]: v for k, v in prefill.items()}, chat=chat)
    except OpenAIError as exc:
        # The OpenAI API's field names, said as the local API's.
        message = str(exc)
        wire, local = next(((w, k) for k, w in _LOCAL_PREFILL_FIELDS.items() if message.startswith(w + " ")),
                           ("", ""))
        raise OpenAIError(f"prefill.{local}{message[len(wire):]}" if wire else message) from None


def systemd_socket() -> socket.socket | None:
    """The listening socket systemd passed (socket activation), if it passed one to this process."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()) or int(os.environ.get("LISTEN_FDS", "0")) < 1:
        return None
    sock = socket.socket(fileno=3)  # SD_LISTEN_FDS_START
    sock.setblocking(False)
    return sock


async def start_local_site(runner: web.AppRunner, path: Path, admin_group: str | None) -> web.BaseSite:
    """Listen on the Unix socket: the one systemd passed (its unit sets mode and group), or a new
    one at ``path``, mode 0660, group-owned by the admin group when one is set."""
    inherited = systemd_socket()
    if inherited is not None:
        site = web.SockSite(runner, inherited)
        await site.start()
        return site
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_socket():
        if _answers(path):
            raise LocalSocketInUse(f"{path} is the socket of a running process: give this instance another "
                                   "socket_path, or stop that one first")
        path.unlink()  # left by a previous run that was killed
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        # Mode and group are set between bind and listen: until it listens, a connection is
        # refused, so no client ever reaches the socket under the umask's mode.
        listener.bind(str(path))
        os.chmod(path, 0o660)
        if admin_group is not None:
            os.chown(path, -1, grp.getgrnam(admin_group).gr_gid)
        listener.listen(socket.SOMAXCONN)
        site = web.SockSite(runner, listener)
        await site.start()
    except BaseException:
        listener.close()
        raise
    return site


class LocalSocketInUse(OSError):
    """Another live process listens on the local API's socket path."""


def _answers(path: Path) -> bool:
    """Whether a process accepts connections on the Unix socket at ``path`` (a killed run's
    socket file refuses them)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()
