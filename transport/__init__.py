"""Messages between daemons over UCX, and an in-memory transport for tests.

- ``messages``: every wire message, one frozen dataclass each, with units and versions.
- ``codec``: frames (orjson header + raw buffers), checked on receipt; no I/O.
- ``ucx.UcxTransport`` and ``memory.InMemoryTransport``: the one ``interface.Transport``.
- ``block_runs``, ``placement``: coalescing KV moves into runs; heartbeat placement diffs.

``ucx`` is imported on its own (``from infinite_llm.transport.ucx import UcxTransport``) so
that code and tests without ``ucxx`` installed can use everything else.
"""
