"""The creditor's share of a step: attention over the segments this instance holds for others.

An ``AttendRequest`` names, per request, the held segment and how many of its tokens to attend
over (from that segment on, across the consecutive segments held here); the keys of a held
segment are all older than the home's query rows (only complete, earlier blocks are ever
moved), so no causal mask applies here. The plan (block tables, lengths) is the same for every
layer of a home's step and is kept until that home's next step.

On a GPU the creditor computes on a stream of its own, of the highest priority, and copies a
small result to the host there: the attend request is served while this instance's own step
still runs on the default stream (its kernels queue behind nothing of that step), and the
transport, which would stage a small device result through the host on the current stream,
does not wait for that step either.
"""

from __future__ import annotations

import math

import torch

from infinite_llm.kernels import MicroAttentionPlan, plan_micro_attention, run_micro_attention
from infinite_llm.transport import wire_trace
from infinite_llm.transport.messages import AttendRequest, AttendResult, AttendSlice

from .ledger import CreditorLedger, LedgerError


class AttendError(ValueError):
    """An attend request that does not match what this instance holds."""


class CreditorAttention:
    """Serves ``AttendRequest`` messages from the pool and the ledger of one instance."""

    def __init__(self, ledger: CreditorLedger, kv_pool: torch.Tensor, num_heads: int,
                 host_staging_bytes: int = 0) -> None:
        self.ledger = ledger
        # Results of at most this many bytes are returned in host memory (on a GPU): the
        # transport's inline limit for device buffers, which it would stage the same way.
        self.host_staging_bytes = host_staging_bytes
        self.kv_pool = kv_pool
        self.num_heads = num_heads
        self.sm_scale = 1.0 / math.sqrt(kv_pool.shape[-1])
        self._plans: dict[int, tuple[int, tuple, MicroAttentionPlan]] = {}  # home -> (step, slices, plan)
        # Lower is higher; torch maps a value past the device's range to its highest priority.
        self.stream = torch.cuda.Stream(kv_pool.device, priority=-16) if kv_pool.is_cuda else None
        # Pinned host memory for the copies of a staged request (its query in, its result out):
        # copies from and to pinned memory run on this stream without a sync each, where
        # pageable ones wait for the stream first. Reused by the next request: every request
        # ends with this stream synchronised, so no copy of the last one is still in flight.
        self._pinned_query = torch.empty(0, dtype=torch.uint8)
        self._pinned_result = torch.empty(0, dtype=torch.uint8)

    def _plan(self, request: AttendRequest) -> MicroAttentionPlan:
        cached = self._plans.get(request.home_inst_id)
        if cached is not None and cached[0] == request.step_id and cached[1] == request.slices:
            return cached[2]
        block_size = self.kv_pool.shape[3]
        tables, lens, starts = [], [], [0]
        for s in request.slices:
            tables.append(self._blocks(request.home_inst_id, s))
            lens.append(s.num_tokens)
            starts.append(starts[-1] + s.num_rows)
        width = max(len(t) for t in tables)
        device = self.kv_pool.device
        block_tables = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device)
        plan = plan_micro_attention(
            block_tables,
            torch.tensor(lens, dtype=torch.int32, device=device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            num_heads=self.num_heads, num_kv_heads=self.kv_pool.shape[4], head_dim=self.kv_pool.shape[5],
            block_size=block_size, num_blocks=self.kv_pool.shape[0],
            max_query_len=max(s.num_rows for s in request.slices), max_kv_len=max(lens),
            check_bounds=False,  # block ids come from this instance's own ledger
        )
        self._plans[request.home_inst_id] = (request.step_id, request.slices, plan)
        return plan

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
        result = self._attend(request) if self.stream is None else self._attend_on_stream(request, num_rows)
        wire_trace.record("serve.done", AttendRequest.TYPE)
        return result

    def _attend_on_stream(self, request: AttendRequest, num_rows: int) -> AttendResult:
        """``_attend`` on this creditor's stream, the result complete when it returns."""
        staged = num_rows * self.num_heads * (self.kv_pool.shape[5] * self.kv_pool.element_size() + 4) <= self.host_staging_bytes
        with torch.cuda.stream(self.stream):
            result = self._attend(request)
            if staged:
                out, lse = self._to_host(result.out, result.lse)
                return AttendResult(result.home_inst_id, result.creditor_inst_id, result.step_id, result.layer,
                                    out, lse)
        # A large result stays on the device: complete once this stream is. (The transport then
        # also waits for the current stream before UCX reads it, as for any device buffer.)
        self.stream.synchronize()
        return result

    def _blocks(self, home_inst_id: int, s: AttendSlice) -> list[int]:
        """The blocks of a slice's ``num_tokens`` tokens from its first segment on, in token
        order. A home asks for the tokens of consecutive segments held here in one slice (a
        long prompt spills a piece per chunk): each segment's id is its first block's index in
        the request, so the next one starts where the last one's blocks end."""
        block_size = self.kv_pool.shape[3]
        if s.num_tokens <= 0:
            raise AttendError(f"request {s.req_id} segment {s.segment_id}: {s.num_tokens} tokens asked")
        needed = -(-s.num_tokens // block_size)
        blocks: list[int] = []
        segment_id = s.segment_id
        while len(blocks) < needed:
            try:
                segment = self.ledger.segment(home_inst_id, s.req_id, segment_id)
            except LedgerError as exc:
                raise AttendError(f"request {s.req_id}: {s.num_tokens} tokens asked from segment {s.segment_id} "
                                  f"on, {len(blocks) * block_size} held there ({exc})") from None
            blocks.extend(segment.block_ids)
            segment_id += len(segment.block_ids)
        return blocks[:needed]

    def _to_device(self, q: torch.Tensor) -> torch.Tensor:
        """A query that landed in host memory, on this pool's device: through pinned memory,
        copied on the current stream (this creditor's) without waiting for it."""
        nbytes = q.numel() * q.element_size()
        if self._pinned_query.numel() < nbytes:
            self._pinned_query = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staging = self._pinned_query[:nbytes].view(q.dtype).view(q.shape)
        staging.copy_(q)
        return staging.to(self.kv_pool.device, non_blocking=True)

    def _to_host(self, out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A small result in host memory, complete: both copies through pinned memory on this
        creditor's stream, one wait for it, then copies of their own (the pinned buffer is the
        next request's)."""
        out_bytes = out.numel() * out.element_size()
        lse_start = -(-out_bytes // 16) * 16  # aligned for lse's float32 whatever out's size
        nbytes = lse_start + lse.numel() * lse.element_size()
        if self._pinned_result.numel() < nbytes:
            self._pinned_result = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out_host = self._pinned_result[:out_bytes].view(out.dtype).view(out.shape)
        lse_host = self._pinned_result[lse_start:nbytes].view(lse.dtype).view(lse.shape)
        out_host.copy_(out, non_blocking=True)
        lse_host.copy_(lse, non_blocking=True)
        self.stream.synchronize()
        return out_host.clone(), lse_host.clone()

    def _attend(self, request: AttendRequest) -> AttendResult:
        plan = self._plan(request)  # first: a refused request leaves no copy in flight
        q = torch.as_tensor(request.q)
        if q.device != self.kv_pool.device:  # on a GPU: landed in host memory (it came inline)
            q = self._to_device(q) if self.stream is not None else q.to(self.kv_pool.device)
        if q.dtype != self.kv_pool.dtype:
            q = q.to(self.kv_pool.dtype)
        wire_trace.record("serve.planned", AttendRequest.TYPE)
        # The partial output in the model's dtype, as the message says: half the bytes of float32
        # (a decode row of Llama-3-8B then fits the 8 KiB that travel inline, 3x faster between
        # two H200s than through CUDA IPC); the home merges in float32.
        state = run_micro_attention(plan, q, self.kv_pool, request.layer, sm_scale=self.sm_scale,
                                    out_dtype=self.kv_pool.dtype)
        wire_trace.record("serve.launched", AttendRequest.TYPE)
        return AttendResult(request.home_inst_id, request.creditor_inst_id, request.step_id, request.layer,
                            state.out, state.lse)

    def forget(self, home_inst_id: int) -> None:
        self._plans.pop(home_inst_id, None)
