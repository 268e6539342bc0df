"""The creditor's share of a step: attention over the segments this instance holds for others.

An ``AttendRequest`` names, per request, the held segment and how many of its tokens to attend
over (from that segment on, across the consecutive segments held here); the keys of a held
segment are all older than the home's query rows (only complete, earlier blocks are ever
moved), so no causal mask applies here. The plan (block tables, lengths, key splits) is the
same for every layer of a home's step, and for its next steps while it asks for the same rows
over the same segments (see below).

On a GPU the creditor computes on a stream of its own, of the highest priority, and copies a
small result to the host there: the attend request is served while this instance's own step
still runs on the default stream (its kernels queue behind nothing of that step), and the
transport, which would stage a small device result through the host on the current stream,
does not wait for that step either.

A decode step asks for the same rows over the same held segments at every layer and every
step, so a GPU creditor serves such a request from a CUDA graph per layer once it has served that
layer of the plan eagerly: the query's copy in, the attention and its split merge, and the
result's copy out are one replay instead of a handful of launches, each of which costs more
host time than the GPU spends on a decode row. A plan is kept while the request names the same
slices over the same held segments (the ledger's objects, compared by identity: a freed, moved
or re-committed segment is a new object); a plan replaced takes its graphs with it.

KV moved here while the request decodes changes its slices every step or two, and a new plan
would then serve eagerly and capture again each time. So a plan is made with room: its block
tables are wider, and its key splits sized for more keys, than the request needs. A request
whose slices have the same rows and fit that room is served by the kept plan, its block
tables and key counts written in place (the kernels read both when they run, graphs included).
While none of the home's segments was freed, the plan's own walk still holds: only the segments
that came after it (a move's) are read, not the hundreds a row may span after many moves.
"""

from __future__ import annotations

import itertools
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import torch

from infinite_llm.engine.dist_attention import BlockIdArrays, table_rows
from infinite_llm.kernels import MicroAttentionPlan, plan_micro_attention, run_micro_attention
from infinite_llm.transport import graph_capture, wire_trace
from infinite_llm.transport.messages import AttendRequest, AttendResult, AttendSlice

from .ledger import CreditorLedger, HeldSegment, LedgerError

log = logging.getLogger(__name__)

# The least room a plan has for keys moved here after it was made, in blocks.
PLAN_ROOM_BLOCKS = 16


class AttendError(ValueError):
    """An attend request that does not match what this instance holds."""


@dataclass
class _LayerGraph:
    """One layer's attention of a plan, captured: reads ``q_dev``, writes ``result_dev``."""

    graph: torch.cuda.CUDAGraph
    q_dev: torch.Tensor  # [num_rows, num_heads, head_dim], the pool's dtype
    result_dev: torch.Tensor  # uint8: out [num_rows, num_heads, head_dim] then lse [num_rows, num_heads] float32


@dataclass
class _ServePlan:
    """What serving one home's request needs, kept until the request changes."""

    slices: tuple[AttendSlice, ...]
    segments: tuple[HeldSegment, ...]  # the ledger's segments the plan reads, in slice order
    plan: MicroAttentionPlan
    # The longest slice's keys may change within [min_tokens, max_tokens] and this plan still
    # serves it (the splits sized for max_tokens are then neither too few nor too thin).
    min_tokens: int
    max_tokens: int
    held_changes: int  # the ledger's count of changes to the home's segments, when last checked
    held_removals: int  # the ledger's count of the home's segments freed, when last walked
    # Per slice: where its segments end in ``segments``, and how many blocks they hold (at least
    # its row's); the block tables as written to the device, [num_slices, width] int32.
    slice_ends: tuple[int, ...]
    slice_blocks: tuple[int, ...]
    tables_host: np.ndarray
    eager_layers: set[int] = field(default_factory=set)  # layers served once without a graph
    graphs: dict[int, _LayerGraph] = field(default_factory=dict)
    graph_pool: tuple | None = None  # the memory pool the plan's graphs share


class CreditorAttention:
    """Serves ``AttendRequest`` messages from the pool and the ledger of one instance."""

    def __init__(self, ledger: CreditorLedger, kv_pool: torch.Tensor, num_heads: int,
                 host_staging_bytes: int = 0, cuda_graphs: bool = True) -> None:
        self.ledger = ledger
        # Results of at most this many bytes are returned in host memory (on a GPU): the
        # transport's inline limit for device buffers, which it would stage the same way.
        self.host_staging_bytes = host_staging_bytes
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.sm_scale = 1.0 / math.sqrt(kv_pool.shape[-1])
        self._plans: dict[int, _ServePlan] = {}  # home -> its last request's plan
        self._block_arrays: dict[int, BlockIdArrays] = {}  # home -> its held segments' block ids as arrays
        # Lower is higher; torch maps a value past the device's range to its highest priority.
        self.stream = torch.cuda.Stream(kv_pool.device, priority=-16) if kv_pool.is_cuda else None
        # Pinned host memory for the copies of a staged request (its query in, its result out):
        # copies from and to pinned memory run on this stream without a sync each, where
        # pageable ones wait for the stream first. Reused by the next request: every request
        # ends with this stream synchronised, so no copy of the last one is still in flight.
        self._pinned: dict[str, torch.Tensor] = {}  # "query", "result" -> uint8 buffer
        self.cuda_graphs = cuda_graphs and self.stream is not None
        self.graph_replays = 0  # requests served from a graph
        self.graph_captures = 0
        self.plans_made = 0
        self.plan_retargets = 0  # requests served by a kept plan over other slices

    @property
    def num_graphs(self) -> int:
        """Graphs held now, over every home's plan."""
        return sum(len(p.graphs) for p in self._plans.values())

    def _plan(self, request: AttendRequest) -> _ServePlan:
        return self.plan_for(request.home_inst_id, request.slices)

    def plan_is_current(self, home: int, plan: _ServePlan, slices: tuple[AttendSlice, ...]) -> bool:
        """Whether ``plan`` is still the home's kept plan for ``slices`` over segments all still
        held (none of the home's freed here since its tables were walked): work queued over it
        ahead of time reads the keys it would read now. Segments committed since do not matter:
        the same slices read the same tokens, which the plan's segments hold."""
        return (self._plans.get(home) is plan and plan.slices == slices
                and plan.held_removals == self.ledger.held_removals.get(home, 0))

    def plan_for(self, home: int, slices: tuple[AttendSlice, ...]) -> _ServePlan:
        """The home's kept plan when ``slices`` name the same rows over the same held segments,
        or the same rows over keys that fit its room (its tables then rewritten in place, on
        the current stream); else a new one (which replaces it, graphs and all). Raises
        AttendError for slices over segments not held here."""
        kept = self._plans.get(home)
        held_changes = self.ledger.held_changes.get(home, 0)
        if kept is not None and kept.slices == slices and kept.held_changes == held_changes:
            return kept
        held_removals = self.ledger.held_removals.get(home, 0)
        if kept is not None and self._extend(home, kept, slices):
            kept.held_changes = held_changes
            return kept
        per_slice = [self._segments(home, s) for s in slices]
        segments = tuple(seg for slice_segments in per_slice for seg in slice_segments)
        slice_ends = tuple(itertools.accumulate(len(slice_segments) for slice_segments in per_slice))
        slice_blocks = tuple(sum(len(seg.block_ids) for seg in slice_segments) for slice_segments in per_slice)
        if kept is not None:
            if (kept.slices == slices and len(kept.segments) == len(segments)
                    and all(a is b for a, b in zip(kept.segments, segments))):
                kept.held_changes, kept.held_removals = held_changes, held_removals
                return kept
            if self._retarget(home, kept, slices, segments, slice_ends, slice_blocks):
                kept.held_changes, kept.held_removals = held_changes, held_removals
                return kept
        block_size = self.kv_pool.shape[3]
        longest = max(s.num_tokens for s in slices)
        # Room for the KV that moves here (or away) while the request decodes: an eighth of the
        # keys, at least PLAN_ROOM_BLOCKS blocks, either way.
        needed_blocks = -(-longest // block_size)
        margin_blocks = max(PLAN_ROOM_BLOCKS, needed_blocks // 8)
        room_blocks = needed_blocks + margin_blocks
        device = self.kv_pool.device
        tables, lens, starts = self._block_tables(home, slices, segments, width=room_blocks)
        plan = plan_micro_attention(
            torch.from_numpy(tables).to(device),
            torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            num_heads=self.num_heads, num_kv_heads=self.kv_pool.shape[4], head_dim=self.kv_pool.shape[5],
            block_size=block_size, num_blocks=self.kv_pool.shape[0],
            max_query_len=max(s.num_rows for s in slices), max_kv_len=room_blocks * block_size,
            check_bounds=False,  # block ids come from this instance's own ledger
        )
        serve_plan = _ServePlan(slices, segments, plan,
                                min_tokens=(needed_blocks - margin_blocks) * block_size,
                                max_tokens=room_blocks * block_size, held_changes=held_changes,
                                held_removals=held_removals, slice_ends=slice_ends, slice_blocks=slice_blocks,
                                tables_host=tables)
        self._plans[home] = serve_plan
        self.plans_made += 1
        return serve_plan

    def _unchanged(self, kept: _ServePlan | None, request: AttendRequest) -> bool:
        """Whether ``kept`` serves ``request`` as it is. Every layer of every step asks this: while
        none of the home's segments changed, the same slices read the same segments, however many
        (KV moved in a piece at a time is a segment a piece), and the walk over them is skipped."""
        return (kept is not None and kept.slices == request.slices
                and kept.held_changes == self.ledger.held_changes.get(request.home_inst_id, 0))

    def _retarget(self, home: int, kept: _ServePlan, slices: tuple[AttendSlice, ...],
                  segments: tuple[HeldSegment, ...], slice_ends: tuple[int, ...],
                  slice_blocks: tuple[int, ...]) -> bool:
        """Point ``kept`` at new slices and segments when they have its rows and their longest
        fits its room. No request is in flight on the plan's tensors: each ends with them read."""
        if len(slices) != len(kept.slices) or any(a.num_rows != b.num_rows for a, b in zip(slices, kept.slices)):
            return False
        longest = max(s.num_tokens for s in slices)
        if not kept.min_tokens <= longest <= kept.max_tokens:
            return False
        tables, lens, _ = self._block_tables(home, slices, segments, width=kept.plan.block_tables.shape[1])
        self._write_tables(home, kept, tables, lens)
        kept.slices, kept.segments, kept.slice_ends, kept.slice_blocks = slices, segments, slice_ends, slice_blocks
        self.plan_retargets += 1
        return True

    def _extend(self, home: int, kept: _ServePlan, slices: tuple[AttendSlice, ...]) -> bool:
        """Serve ``slices`` with ``kept`` by reading only the segments that came since, when
        none of the home's segments was freed since it was walked, the slices start where its
        own did with the same rows, and their longest fits its room. A move adds a segment
        after those a decode row reads, and each one would otherwise mean a walk over every
        segment held for the row (hundreds, after a few hundred moves). False: the full way."""
        if (kept.held_removals != self.ledger.held_removals.get(home, 0) or len(slices) != len(kept.slices)
                or not kept.min_tokens <= max(s.num_tokens for s in slices) <= kept.max_tokens):
            return False
        block_size = self.kv_pool.shape[3]
        width = kept.tables_host.shape[1]
        segments: list[HeldSegment] = []
        ends: list[int] = []
        blocks: list[int] = []
        writes: list[tuple[int, int, np.ndarray]] = []  # (row, first column, block ids)
        begin = 0
        for row, (s, old, end, covered) in enumerate(zip(slices, kept.slices, kept.slice_ends, kept.slice_blocks)):
            if (s.req_id, s.segment_id, s.row_start, s.num_rows) != (old.req_id, old.segment_id, old.row_start,
                                                                      old.num_rows) or s.num_tokens <= 0:
                return False
            row_segments = kept.segments[begin:end]
            begin = end
            needed, had = -(-s.num_tokens // block_size), -(-old.num_tokens // block_size)
            if needed > width:
                return False
            last = row_segments[-1]
            next_id = last.segment_id + len(last.block_ids)
            came: list[HeldSegment] = []
            while covered < needed:
                segment = self.ledger.held.get((home, s.req_id, next_id))
                if segment is None:
                    return False  # the full walk says what is missing
                came.append(segment)
                covered += len(segment.block_ids)
                next_id += len(segment.block_ids)
            row_segments += tuple(came)
            if needed > had:
                writes.append((row, had, _blocks_at(row_segments, covered, had, needed)))
            segments.extend(row_segments)
            ends.append(len(segments))
            blocks.append(covered)
        tables = kept.tables_host
        for row, first, ids in writes:
            tables[row, first:first + len(ids)] = ids
        self._write_tables(home, kept, tables, [s.num_tokens for s in slices])
        kept.slices, kept.segments, kept.slice_ends, kept.slice_blocks = slices, tuple(segments), tuple(ends), tuple(blocks)
        kept.held_removals = self.ledger.held_removals.get(home, 0)
        self.plan_retargets += 1
        return True

    def _write_tables(self, home: int, kept: _ServePlan, tables: np.ndarray, lens: list[int]) -> None:
        """The plan's block tables and key counts rewritten in place on the device (graphs read
        them there when they replay)."""
        try:
            kept.plan.block_tables.copy_(torch.from_numpy(tables))
            kept.plan.kv_lens.copy_(torch.from_numpy(np.array(lens, dtype=np.int32)))
        except BaseException:
            # Half rewritten, the plan matches neither the old slices nor the new: drop it.
            self._plans.pop(home, None)
            raise
        kept.tables_host = tables

    def _block_tables(self, home: int, slices: tuple[AttendSlice, ...], segments: tuple[HeldSegment, ...],
                      width: int | None = None) -> tuple[np.ndarray, list[int], list[int]]:
        """Per slice its blocks (from its segments, in order) as a row of an int32 table of
        ``width`` columns (None: the widest row's), 0-padded; its keys; the rows' start offsets.
        The segments' blocks come from arrays kept per home: a plan changed by a move reads
        thousands of blocks that did not move."""
        block_size = self.kv_pool.shape[3]
        arrays = self._block_arrays.setdefault(home, BlockIdArrays())
        rows: list[list[np.ndarray]] = []
        lens, starts = [], [0]
        held = iter(segments)
        for s in slices:
            needed = -(-s.num_tokens // block_size)
            pieces: list[np.ndarray] = []
            found = 0
            while found < needed:
                piece = arrays.of(next(held).block_ids)[:needed - found]
                pieces.append(piece)
                found += len(piece)
            rows.append(pieces)
            lens.append(s.num_tokens)
            starts.append(starts[-1] + s.num_rows)
        arrays.end_step()
        return table_rows(rows, width), lens, starts

    def attend(self, request: AttendRequest) -> AttendResult:
        """Partial attention of the request's rows over the held segments.

        ``request.q``: ``[num_rows, num_heads, head_dim]``; the result's ``out`` has that shape
        (the pool's dtype) and ``lse`` is ``[num_rows, num_heads]`` float32, natural log. On a
        GPU both come back complete: in host memory up to ``host_staging_bytes``.
        """
        if not 0 <= request.layer < self.kv_pool.shape[1]:
            raise AttendError(f"layer {request.layer} outside [0, {self.kv_pool.shape[1]})")
        num_rows = sum(s.num_rows for s in request.slices)
        if tuple(request.q.shape) != (num_rows, self.num_heads, self.kv_pool.shape[5]):
            raise AttendError(f"q has shape {list(request.q.shape)}; the slices name {num_rows} rows and this "
                              f"model has {self.num_heads} heads of dim {self.kv_pool.shape[5]}")
        wire_trace.record("serve.start", AttendRequest.TYPE)
        if self.stream is None:
            serve_plan = self._plan(request)  # first: a refused request leaves no copy in flight
            result = self._attend(request, serve_plan)
        else:
            serve_plan = self._plans.get(request.home_inst_id)
            if not self._unchanged(serve_plan, request):
                # The plan's tensors are made, and a multi-row plan's tiles computed, on this
                # creditor's stream: ahead of its attention, and behind nothing of this
                # instance's own step. (A kept plan makes no tensors: no stream is entered.)
                with torch.cuda.stream(self.stream):
                    serve_plan = self._plan(request)
            result = self._attend_on_stream(request, serve_plan, num_rows)
        wire_trace.record("serve.done", AttendRequest.TYPE)
        return result

    def _attend_on_stream(self, request: AttendRequest, serve_plan: _ServePlan, num_rows: int) -> AttendResult:
        """``_attend`` on this creditor's stream, the result complete when it returns; a small
        request from a layer's graph once that layer of the plan has run eagerly."""
        staged = self._result_layout(num_rows)[2] <= self.host_staging_bytes
        q = torch.as_tensor(request.q)
        if staged and self.cuda_graphs and not q.is_cuda:
            graph = serve_plan.graphs.get(request.layer)
            if graph is None and request.layer in serve_plan.eager_layers:
                graph = self._capture(serve_plan, request.layer, q)
            if graph is not None:
                out, lse = self._replay(graph, q)
                return AttendResult(request.home_inst_id, request.creditor_inst_id, request.step_id, request.layer,
                                    out, lse)
        with torch.cuda.stream(self.stream):
            result = self._attend(request, serve_plan)
            if staged:
                out, lse = self._to_host(result.out, result.lse)
                serve_plan.eager_layers.add(request.layer)
                return AttendResult(result.home_inst_id, result.creditor_inst_id, result.step_id, result.layer,
                                    out, lse)
        # A large result stays on the device: complete once this stream is. (The transport then
        # also waits for the current stream before UCX reads it, as for any device buffer.)
        self.stream.synchronize()
        return result

    def _result_layout(self, num_rows: int) -> tuple[int, int, int]:
        """Where a result of ``num_rows`` lies in one buffer: (out's bytes, lse's offset, total
        bytes); lse is aligned for its float32 whatever out's size."""
        out_bytes = num_rows * self.num_heads * self.kv_pool.shape[5] * self.kv_pool.element_size()
        lse_start = -(-out_bytes // 16) * 16
        return out_bytes, lse_start, lse_start + num_rows * self.num_heads * 4

    def _result_views(self, buffer: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``out [num_rows, num_heads, head_dim]`` (the pool's dtype) and ``lse [num_rows,
        num_heads]`` float32 as views of a uint8 ``buffer`` laid out by ``_result_layout``."""
        out_bytes, lse_start, nbytes = self._result_layout(num_rows)
        out = buffer[:out_bytes].view(self.kv_pool.dtype).view(num_rows, self.num_heads, self.kv_pool.shape[5])
        return out, buffer[lse_start:nbytes].view(torch.float32).view(num_rows, self.num_heads)

    def _capture(self, serve_plan: _ServePlan, layer: int, q: torch.Tensor) -> _LayerGraph | None:
        """One layer's attention of the plan as a graph that reads ``q_dev`` and writes
        ``result_dev`` (out then lse, as ``_result_layout`` places them). None, and no graphs from
        then on, when capturing fails: the eager path serves the same requests."""
        device = self.kv_pool.device
        q_dev = torch.empty(q.shape, dtype=self.kv_pool.dtype, device=device)
        result_dev = torch.empty(self._result_layout(q.shape[0])[2], dtype=torch.uint8, device=device)
        out_dev, lse_dev = self._result_views(result_dev, q.shape[0])
        if serve_plan.graph_pool is None:
            serve_plan.graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()

        def body() -> None:
            state = run_micro_attention(serve_plan.plan, q_dev, self.kv_pool, layer,
                                        sm_scale=self.sm_scale, out_dtype=self.kv_pool.dtype)
            out_dev.copy_(state.out)
            lse_dev.copy_(state.lse)
        try:
            with torch.cuda.stream(self.stream):
                # This thread's work only: the engine's thread may call into CUDA meanwhile. (No
                # torch.cuda.graph(): it collects garbage and synchronises the device first.)
                graph_capture.capture(graph, serve_plan.graph_pool, body)
        except Exception as exc:  # noqa: BLE001  (serving goes on, eagerly)
            log.warning("creditor: capturing layer %d's attention failed, serving eagerly from now on: %s", layer, exc)
            self.cuda_graphs = False
            return None
        captured = _LayerGraph(graph, q_dev, result_dev)
        serve_plan.graphs[layer] = captured
        self.graph_captures += 1
        return captured

    def _replay(self, captured: _LayerGraph, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A host query through a layer's graph: the result in host memory, complete."""
        staging = self._staged_query(q, self.kv_pool.dtype)
        result_host = self._pinned_buffer("result", captured.result_dev.numel())
        wire_trace.record("serve.planned", AttendRequest.TYPE)
        with torch.cuda.stream(self.stream):
            captured.q_dev.copy_(staging, non_blocking=True)
            captured.graph.replay()
            result_host.copy_(captured.result_dev, non_blocking=True)
        wire_trace.record("serve.launched", AttendRequest.TYPE)
        self.stream.synchronize()
        self.graph_replays += 1
        out, lse = self._result_views(result_host, q.shape[0])
        return out.clone(), lse.clone()

    def _pinned_buffer(self, which: str, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the pinned buffer for queries or results, grown as needed.
        Reused by the next request: every request ends with this creditor's stream
        synchronised, so no copy of the last one is still in flight."""
        buffer = self._pinned.get(which)
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._pinned[which] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return buffer[:nbytes]

    def _staged_query(self, q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``q`` copied (as ``dtype``) into the pinned query buffer, for a copy to the device
        that waits for nothing."""
        staging = self._pinned_buffer("query", q.numel() * dtype.itemsize).view(dtype).view(q.shape)
        staging.copy_(q)
        return staging

    def _segments(self, home_inst_id: int, s: AttendSlice) -> list[HeldSegment]:
        """The held segments that a slice's ``num_tokens`` tokens lie in, from its first segment
        on, in token order. A home asks for the tokens of consecutive segments held here in one
        slice (a long prompt spills a piece per chunk): each segment's id is its first block's
        index in the request, so the next one starts where the last one's blocks end."""
        block_size = self.kv_pool.shape[3]
        if s.num_tokens <= 0:
            raise AttendError(f"request {s.req_id} segment {s.segment_id}: {s.num_tokens} tokens asked")
        needed = -(-s.num_tokens // block_size)
        segments: list[HeldSegment] = []
        found = 0
        segment_id = s.segment_id
        while found < needed:
            try:
                segment = self.ledger.segment(home_inst_id, s.req_id, segment_id)
            except LedgerError as exc:
                raise AttendError(f"request {s.req_id}: {s.num_tokens} tokens asked from segment {s.segment_id} "
                                  f"on, {found * block_size} held there ({exc})") from None
            segments.append(segment)
            found += len(segment.block_ids)
            segment_id += len(segment.block_ids)
        return segments

    def _to_device(self, q: torch.Tensor) -> torch.Tensor:
        """A query that landed in host memory, on this pool's device: through pinned memory,
        copied on the current stream (this creditor's) without waiting for it."""
        return self._staged_query(q, q.dtype).to(self.kv_pool.device, non_blocking=True)

    def _to_host(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A small result in host memory, complete: both copies through pinned memory on this
        creditor's stream, one wait for it, then copies of their own (the pinned buffer is the
        next request's)."""
        result_host = self._pinned_buffer("result", self._result_layout(out.shape[0])[2])
        out_host, lse_host = self._result_views(result_host, out.shape[0])
        out_host.copy_(out, non_blocking=True)
        lse_host.copy_(lse, non_blocking=True)
        self.stream.synchronize()
        return out_host.clone(), lse_host.clone()

    def _attend(self, request: AttendRequest, serve_plan: _ServePlan) -> AttendResult:
        q = torch.as_tensor(request.q)
        if q.device != self.kv_pool.device:  # on a GPU: landed in host memory (it came inline)
            q = self._to_device(q) if self.stream is not None else q.to(self.kv_pool.device)
        if q.dtype != self.kv_pool.dtype:
            q = q.to(self.kv_pool.dtype)
        wire_trace.record("serve.planned", AttendRequest.TYPE)
        # The partial output in the model's dtype, as the message says: half the bytes of float32
        # (a decode row of Llama-3-8B then fits the 8 KiB that travel inline, 3x faster between
        # two H200s than through CUDA IPC); the home merges in float32.
        state = run_micro_attention(serve_plan.plan, q, self.kv_pool, request.layer, sm_scale=self.sm_scale,
                                    out_dtype=self.kv_pool.dtype)
        wire_trace.record("serve.launched", AttendRequest.TYPE)
        return AttendResult(request.home_inst_id, request.creditor_inst_id, request.step_id, request.layer,
                            state.out, state.lse)

    def forget(self, home_inst_id: int) -> None:
        self._plans.pop(home_inst_id, None)
        self._block_arrays.pop(home_inst_id, None)


def _blocks_at(segments: tuple[HeldSegment, ...], total: int, first: int, end: int) -> np.ndarray:
    """The block ids at positions [first, end) of the segments' blocks laid end to end (``total``
    of them), read from the last segment back: only the few at the end are looked at."""
    pieces = []
    stop = total
    for segment in reversed(segments):
        start = stop - len(segment.block_ids)
        if start < end:
            lo, hi = max(start, first), min(stop, end)
            if lo < hi:
                pieces.append(segment.block_ids[lo - start:hi - start])
        if start <= first:
            break
        stop = start
    return np.fromiter(itertools.chain.from_iterable(reversed(pieces)), dtype=np.int32, count=end - first)
