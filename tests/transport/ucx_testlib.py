"""Helpers of the UCX tests that run transports in this process. Import it after
``pytest.importorskip("ucxx")``: it imports the UCX transport."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from infinite_llm.transport.interface import TransportConfig
from infinite_llm.transport.ucx import UcxTransport


@contextlib.asynccontextmanager
async def started(handler, placer=None, **config) -> AsyncIterator[UcxTransport]:
    """A transport of this process, listening, closed on the way out."""
    transport = UcxTransport(TransportConfig(**{"request_timeout_s": 10, **config}))
    await transport.start(handler, placer)
    try:
        yield transport
    finally:
        await transport.close()
