"""Timestamps of messages on their way through the transport and the daemon.

For finding where a round trip's time goes: each process records ``(time, event, msg_type,
msg_id)`` at the points a message passes (encoded, posted, header received, handled, reply
posted, reply delivered, and the daemon's own steps around an attend request). ``time`` is
``time.perf_counter()``, which on Linux reads ``CLOCK_MONOTONIC``: the records of processes on
one host share a time base and can be joined on ``(sender, msg_id)``.

Off unless the environment variable ``INFLLM_WIRE_TRACE`` names a directory; then every
process that imports the transport records its events in memory (up to ``MAX_EVENTS``) and
writes them to ``<dir>/wire-<pid>.jsonl`` at exit. Off, an event costs one test of a global.
"""

from __future__ import annotations

import atexit
import os
import time
from pathlib import Path

import orjson

__all__ = ["MAX_EVENTS", "enabled", "record", "write"]

# A decode step of a 32-layer model with one creditor records about 400 events.
MAX_EVENTS = 2_000_000

_events: list[tuple[float, str, str, int]] | None = None
_directory: Path | None = None


def enabled() -> bool:
    return _events is not None


def record(event: str, msg_type: str = "", msg_id: int = -1) -> None:
    """Note that ``event`` happened now (to the message ``msg_type``/``msg_id`` where known)."""
    if _events is not None and len(_events) < MAX_EVENTS:
        _events.append((time.perf_counter(), event, msg_type, msg_id))


def write() -> Path | None:
    """Write this process's events (one JSON array per line) and return the file, if tracing."""
    if _events is None or _directory is None:
        return None
    _directory.mkdir(parents=True, exist_ok=True)
    path = _directory / f"wire-{os.getpid()}.jsonl"
    with path.open("wb") as f:
        for entry in _events:
            f.write(orjson.dumps(entry) + b"\n")
    return path


def _start_from_environment() -> None:
    global _events, _directory
    directory = os.environ.get("INFLLM_WIRE_TRACE")
    if directory:
        _events = []
        _directory = Path(directory)
        atexit.register(write)


_start_from_environment()
