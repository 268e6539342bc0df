"""Iteration-level scheduling with chunked prefill. Pure logic: token ids and block counts only.

Each step the scheduler gives every running request its next tokens (one for a decoding
request, a chunk of the prompt for a prefilling one) within a token budget, then admits waiting
requests first-come-first-served while the budget, the request limit and the home pool allow.
A running request that cannot get a block makes the newest running request give its blocks
back (it waits and recomputes later), so a request never writes into blocks it does not own;
the newest itself takes the part of its chunk that the home pool holds, and gives its blocks
back only when not one token fits. A request alone starts on the part of its first chunk that
the home pool holds, so that a chunk larger than the pool never blocks the queue.

A waiting request that cannot start yet (its context needs memory that is not free) lets up
to ``queue_bypass_limit`` later requests that can start go ahead of it; then the queue waits
for it, so that a long request is delayed by a bounded number of short ones, not starved.

A decoding request whose KV is split over other instances makes every layer of its step wait
for their parts, and every request batched with it waits too. With ``split_decode_interval``
n > 1 such requests decode in one step of n while other requests run; the steps between carry
the others alone, at the pace of the home's own device, unless the others get nothing (then the
split ones run rather than leave the step empty). (Prompt chunks always run: a long prompt held
back would hold up the queue behind it.)

A running request whose KV lost a range (an instance holding it died) recomputes the range
before anything else of it runs: its chunks take the range's tokens, in token order, into new
home blocks, and sample nothing. It gets home blocks as a prefill does: the newest running
request gives its blocks back when there are too few, the request itself last (it then
recomputes everything from the start, as after any preemption).
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A request's tokens and progress, as the scheduler sees them."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K and V are written
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    num_bypassed: int = 0  # later requests started while this one waited at the queue's head

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without joining the whole prompt and output first (a
        decode step of a long request would copy its prompt every step)."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt:end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - num_prompt]

    @property
    def is_prefilling(self) -> bool:
        """Whether the next step is a chunk rather than one token: more than one known token
        lacks K and V (the prompt, or the prompt and outputs recomputed after a preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens ``[start, start + num_tokens)`` of one request, computed in this step."""

    request_id: str
    start: int
    num_tokens: int
    samples: bool  # the chunk reaches the request's last known token: a new token is sampled
    recomputes: bool = False  # tokens of a lost range, computed again: the request's progress stays


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]  # requests sent back to waiting in this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 can_start: Callable[[Request], bool] | None = None, queue_bypass_limit: int = 0,
                 split_decode_interval: int = 1) -> None:
        """``can_start``: whether a waiting request may start (or restart) now, beyond the room
        for its first chunk; None: the first chunk's room is enough. ``queue_bypass_limit``:
        later requests that may start ahead of a head that cannot (0: first come, first served)."""
        if queue_bypass_limit < 0:
            raise ValueError(f"queue_bypass_limit must be >= 0, got {queue_bypass_limit}")
        if split_decode_interval < 1:
            raise ValueError(f"split_decode_interval must be at least 1, got {split_decode_interval}")
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.can_start = can_start
        self.queue_bypass_limit = queue_bypass_limit
        self.split_decode_interval = split_decode_interval
        self._num_steps = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self._num_steps += 1
        held_back = self._split_decodes_held_back()
        budget = self._schedule_running(lambda r: r.request_id not in held_back, budget, chunks, preempted)
        if held_back and not chunks:
            # The others got nothing (they preempted themselves): the split decodes run rather
            # than leave the step empty.
            budget = self._schedule_running(lambda r: r.request_id in held_back, budget, chunks, preempted)
        # After a preemption the freed blocks are left for the running requests' next steps;
        # but a step that would otherwise be empty admits (the preempted request restarts).
        if not preempted or not chunks:
            self._admit(budget, chunks)
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def _schedule_running(self, selected: Callable[[Request], bool], budget: int, chunks: list[ScheduledChunk],
                          preempted: list[str]) -> int:
        """Give each selected running request its next tokens, in admission order; append the
        chunks and the preempted requests' ids; return the budget left."""
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if not selected(request):
                index += 1
                continue
            if self.block_manager.has_lost(request.request_id):
                budget = self._schedule_recompute(request, budget, chunks, preempted)
                if request.status is not RequestStatus.RUNNING:
                    break
                index += 1
                continue
            end = request.num_computed_tokens + min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.block_manager.can_allocate(request.request_id, end):
                victim = self.running[-1]
                if victim is request:
                    # Rather than throw away its own work, the newest request takes the part of
                    # its chunk that the home pool holds; it gives its blocks back only when not
                    # one token fits.
                    end = min(end, self.block_manager.max_allocatable_tokens(request.request_id))
                    if end > request.num_computed_tokens:
                        break
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            num_new = end - request.num_computed_tokens
            self.block_manager.allocate(request.request_id, end)
            chunks.append(ScheduledChunk(request.request_id, request.num_computed_tokens, num_new, end == request.num_tokens))
            budget -= num_new
            index += 1
        return budget

    def _schedule_recompute(self, request: Request, budget: int, chunks: list[ScheduledChunk],
                            preempted: list[str]) -> int:
        """The next chunk of the request's first lost range, within ``budget``; return the
        budget left. Too small a budget for one block of the range leaves it to the next step."""
        bm = self.block_manager
        request_id = request.request_id
        start, _ = bm.lost_range(request_id)
        end = bm.fill_end(request_id, budget)
        if end <= start:
            return budget
        while not bm.can_fill(request_id, end):
            victim = self.running[-1]
            if victim is request:
                end = bm.fill_end(request_id, bm.num_free_blocks(bm.home_instance_id) * bm.block_size)
                if end > start:
                    break
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return budget
        bm.fill_lost(request_id, end)
        chunks.append(ScheduledChunk(request_id, start, end - start, samples=False, recomputes=True))
        return budget - (end - start)

    def _admit(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        """Start waiting requests while the budget, ``max_num_seqs`` and the home pool allow;
        append their first chunks."""
        position = 0  # in the queue: past a head that cannot start, while it may be bypassed
        while position < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[position]
            end = request.num_computed_tokens + min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.running and not self.block_manager.can_allocate(request.request_id, end):
                # Alone, a request whose first chunk is larger than the home pool starts on the
                # part the pool holds (its written blocks are then lent to creditors to make room
                # for the rest); while others run, it waits for blocks to come back.
                end = min(end, self.block_manager.max_allocatable_tokens(request.request_id))
            if end <= request.num_computed_tokens or not self.block_manager.can_allocate(request.request_id, end) or (
                    self.can_start is not None and not self.can_start(request)):
                if position == 0 and self.waiting[0].num_bypassed < self.queue_bypass_limit:
                    position = 1
                    continue
                break  # wait for blocks to come back
            del self.waiting[position]
            if position:
                self.waiting[0].num_bypassed += 1
                if self.waiting[0].num_bypassed >= self.queue_bypass_limit:
                    position = len(self.waiting)  # the head's turn: no one else starts first
            num_new = end - request.num_computed_tokens
            self.block_manager.allocate(request.request_id, end)
            request.status = RequestStatus.RUNNING
            request.num_bypassed = 0  # if it waits again (preempted), its allowance starts afresh
            self.running.append(request)
            chunks.append(ScheduledChunk(request.request_id, request.num_computed_tokens, num_new, end == request.num_tokens))
            budget -= num_new

    def _split_decodes_held_back(self) -> set[str]:
        """The decoding split requests this step leaves out: none in one step of
        ``split_decode_interval``, nor when no other request would run in their place."""
        if self.split_decode_interval == 1 or self._num_steps % self.split_decode_interval == 0:
            return set()
        held = {r.request_id for r in self.running
                if r.num_tokens - r.num_computed_tokens == 1 and self.block_manager.is_split(r.request_id)
                and not self.block_manager.has_lost(r.request_id)}
        return held if len(held) < len(self.running) else set()

    def finish(self, request_id: str) -> None:
        """Drop a request (done, stopped or aborted) and free its blocks."""
        request = self.requests.pop(request_id)
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.block_manager.free(request_id)

    def _preempt(self, request: Request) -> None:
        """Free the request's blocks; it goes back to the head of the queue and recomputes."""
        self.running.remove(request)
        self.block_manager.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.waiting.appendleft(request)
