"""Capturing a CUDA graph so that a capture that fails leaves the process as it was.

``torch.cuda.CUDAGraph.capture_begin`` routes the capturing stream's allocations into the
graph's memory pool, then begins the stream's capture; ``capture_end`` ends the capture, checks
its result and only then undoes the routing. A capture that fails (an operation that cannot be
captured, an earlier asynchronous error surfacing) therefore leaves the routing in place, naming
a graph that the caller then drops: the allocator keeps believing a capture is under way (memory
freed on other streams is never reused) and a later capture reads the dropped graph. ``capture``
ends the stream's capture, undoes the routing and keeps the failed graph, so that the caller can
go on without graphs. No I/O here.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# Graphs whose capture failed: kept for the process's life, in case the allocator still names
# them (at most one per owner that turns its graphs off after a failure).
_FAILED: list[torch.cuda.CUDAGraph] = []


def capture(graph: torch.cuda.CUDAGraph, memory_pool: tuple[int, int], body: Callable[[], None]) -> None:
    """Capture ``body()``'s work on the current stream into ``graph``, its allocations from
    ``memory_pool`` (``torch.cuda.graph_pool_handle()``, or another graph's ``pool()``;
    named here, since a graph tells its own only after a capture that succeeded). Only this thread's CUDA calls are
    captured (another thread's meanwhile are neither part of the graph nor an error), and the
    garbage collector waits: a collection that frees pinned or device memory meanwhile would
    record events on the capturing stream. Raises what failed, after the stream has left the
    capture, the allocator's routing has been undone and ``graph`` has been kept."""
    collecting = gc.isenabled()
    gc.disable()
    begun = False
    try:
        graph.capture_begin(pool=memory_pool, capture_error_mode="thread_local")
        begun = True
        body()
        graph.capture_end()
    except BaseException:
        _abandon(graph, memory_pool, begun)
        raise
    finally:
        if collecting:
            gc.enable()


def _abandon(graph: torch.cuda.CUDAGraph, memory_pool: tuple[int, int], begun: bool) -> None:
    _FAILED.append(graph)
    if begun and torch.cuda.is_current_stream_capturing():
        try:
            graph.capture_end()  # ends the stream's capture even where it raises
        except RuntimeError:
            pass
    try:
        torch._C._cuda_endAllocateToPool(torch.cuda.current_device(), memory_pool)
    except (RuntimeError, AttributeError, TypeError):
        pass  # undone already (capture_end got that far), or never begun


def pool_for_capture(memory_pool: tuple[int, int] | None, held: bool) -> tuple[int, int]:
    """The pool a new capture should use: ``memory_pool`` while a live graph still holds it
    (``held``), else a new one. Once no graph holds a pool, the allocator refuses (an internal
    assert, ``use_count > 0``) any further capture into it until its memory has been released;
    an owner that drops all its graphs (a plan replaced, mailboxes gone) starts a new pool."""
    return memory_pool if held and memory_pool is not None else torch.cuda.graph_pool_handle()
