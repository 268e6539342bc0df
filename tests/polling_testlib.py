"""Bounded waits for a condition that another task or process brings about."""

from __future__ import annotations

import asyncio
import time


async def until(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Seconds until ``predicate()`` holds, looked at every ``poll_s``; AssertionError after
    ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout_s:
            raise AssertionError(f"{what}: not within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - started
