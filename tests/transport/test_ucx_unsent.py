"""A connection keeps the replies UCX has not sent yet, and breaks on a failed or late one."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

ucx = pytest.importorskip("infinite_llm.transport.ucx")
from ucxx.exceptions import UCXError  # noqa: E402

from infinite_llm.transport import codec  # noqa: E402
from infinite_llm.transport.interface import TransportConfig  # noqa: E402


class FakeRequest:
    def __init__(self) -> None:
        self.completed = False
        self.error: Exception | None = None

    def check_error(self) -> None:
        if self.error is not None:
            raise self.error


def connection(frame_timeout_s: float = 10.0):
    endpoint = SimpleNamespace(_ep=SimpleNamespace(raise_on_error=lambda: None), aborted=[],
                               _tags={"msg_send": 1, "msg_recv": 2}, closed=False)
    endpoint.abort = lambda: endpoint.aborted.append(True)
    return ucx._Connection(endpoint, "test", TransportConfig(frame_timeout_s=frame_timeout_s),
                           progress=SimpleNamespace(poke=lambda: None))


def on_a_loop(check):
    """Run ``check`` on an event loop (breaking a connection schedules a wake-up there)."""
    async def run():
        check()
    asyncio.run(run())


def frame(tag: bytes) -> codec.EncodedFrame:
    return codec.EncodedFrame(header=tag, buffers=())


def test_sent_replies_are_dropped_at_the_next_post_and_unsent_ones_kept() -> None:
    conn = connection()
    first, second = FakeRequest(), FakeRequest()
    conn.keep_until_sent([first], frame(b"a"))
    conn.keep_until_sent([second], frame(b"b"))
    assert [f.header for _, f, _ in conn.unsent] == [b"a", b"b"]
    first.completed = True
    conn.keep_until_sent([FakeRequest()], frame(b"c"))
    assert [f.header for _, f, _ in conn.unsent] == [b"b", b"c"]
    assert not conn.broken


def test_a_failed_send_breaks_the_connection() -> None:
    conn = connection()
    failed = FakeRequest()
    conn.keep_until_sent([failed], frame(b"a"))
    failed.completed, failed.error = True, UCXError("peer gone")
    on_a_loop(lambda: conn.keep_until_sent([FakeRequest()], frame(b"b")))
    assert conn.broken and conn.endpoint.aborted == [True]


def test_a_reply_not_sent_within_the_frame_timeout_breaks_the_connection(monkeypatch) -> None:
    conn = connection(frame_timeout_s=5.0)
    now = [100.0]
    monkeypatch.setattr(ucx.time, "monotonic", lambda: now[0])
    conn.keep_until_sent([FakeRequest()], frame(b"a"))
    now[0] = 104.0
    conn.keep_until_sent([FakeRequest()], frame(b"b"))
    assert not conn.broken
    now[0] = 105.5
    on_a_loop(lambda: conn.keep_until_sent([FakeRequest()], frame(b"c")))
    assert conn.broken
    assert [f.header for _, f, _ in conn.unsent] == [b"a", b"b", b"c"]  # kept while UCX cancels


def test_frames_of_a_broken_connection_go_once_ucx_is_done_with_them() -> None:
    conn = connection()
    failed, cancelled = FakeRequest(), FakeRequest()
    conn.keep_until_sent([failed], frame(b"a"))
    conn.keep_until_sent([cancelled], frame(b"b"))
    failed.completed, failed.error = True, UCXError("peer gone")
    on_a_loop(conn.sweep_unsent)
    assert conn.broken and [f.header for _, f, _ in conn.unsent] == [b"b"]
    cancelled.completed, cancelled.error = True, UCXError("cancelled")
    conn.sweep_unsent()
    assert conn.unsent == [] and conn.endpoint.aborted == [True]  # broken once, not again
