"""Transport test set-up: UCX over loopback only, and one event loop for the UCX tests.

UCX keeps one context per process, bound to the event loop that first used it, so every UCX
test in this process runs on the one loop of the ``ucx_loop`` fixture.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
from collections.abc import Coroutine, Iterator
from pathlib import Path

import pytest

# Loopback: TCP, shared memory and self; no InfiniBand or CUDA transports are probed.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

PEER_SCRIPT = Path(__file__).with_name("ucx_peer.py")


def run_bounded(loop: asyncio.AbstractEventLoop, coroutine: Coroutine, timeout_s: float):
    """Run ``coroutine`` on ``loop``, failing the test if it takes over ``timeout_s``."""
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coroutine
    return loop.run_until_complete(bounded())


def shm_temporary_directory() -> tempfile.TemporaryDirectory:
    """A directory of its own on the host's shared memory (a temporary one without it)."""
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    return tempfile.TemporaryDirectory(dir=base)


@pytest.fixture
def directory() -> Iterator[str]:
    """A directory of its own on the host's shared memory, for the files of regions and rings."""
    with shm_temporary_directory() as path:
        yield path


@pytest.fixture(scope="session")
def ucx_loop() -> Iterator[asyncio.AbstractEventLoop]:
    pytest.importorskip("ucxx")
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="session")
def peer_command() -> list[str]:
    return [sys.executable, str(PEER_SCRIPT)]
