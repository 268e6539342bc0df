"""The engine: requests in, tokens out, one step at a time (schedule, run, postprocess).

One :class:`LLMEngine` is one home instance. Its KV pools are ``config.pool_blocks``: pool 0
is the home's, where every new token's K and V are written; the others stand for creditor
instances in this process and are reached only through :class:`RemoteAttention`, so a
transport can take their place.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from infinite_llm.kernels import KVPoolShape, allocate_kv_pool

from .block_manager import BlockManager, Segment, SegmentMove
from .config import EngineConfig
from .dist_attention import (BlockIdArrays, DevicePart, DistAttention, InProcessRemoteAttention, RemoteAttention,
                             StepAttention, build_step_attention)
from .loader import Checkpoint, load_checkpoint
from .model import LlamaModel
from .cuda_graphs import DEFAULT_BATCH_SIZES, LocalDecodeGraphs, PiecewiseDecodeGraphs, SplitDecodeGraphs
from .lending import KVLender
from .sampling import Sampler, SamplingParams
from .scheduler import Request, Scheduler, SchedulerOutput
from .tokenizer import ChatMessage, IncrementalDetokenizer

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class RequestRejected(ValueError):
    """A request that this engine can never serve (bad input, or more KV than all pools hold)."""


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request.

    ``token_ids`` and ``text`` (the whole output so far) are made when read, from the request's
    own lists, which only grow: an output made every step for every request would otherwise copy
    the whole output each time, quadratic in a long output's length.
    """

    request_id: str
    new_token_ids: tuple[int, ...]  # sampled in this step
    new_text: str  # text completed in this step (held back while it may start a stop string)
    num_output_tokens: int  # output tokens so far, this step's included
    finished: bool
    finish_reason: str | None  # "stop", "length" or "abort" once finished
    _output_token_ids: list[int] = field(repr=False, compare=False)  # the request's, appended to
    _text_pieces: list[str] = field(repr=False, compare=False)  # each step's new_text, appended to
    _num_text_pieces: int = field(repr=False, compare=False)

    @property
    def token_ids(self) -> tuple[int, ...]:
        """Every output token so far."""
        return tuple(self._output_token_ids[:self.num_output_tokens])

    @property
    def text(self) -> str:
        """The output text so far (final once finished)."""
        return "".join(self._text_pieces[:self._num_text_pieces])


@dataclass(frozen=True)
class LostKV:
    """What :meth:`LLMEngine.recover_lost` found: the requests that recompute their lost
    tokens, and those that cannot (the cluster has not the memory for them)."""

    recomputing: dict[str, int]  # request id -> tokens to recompute
    unrecoverable: tuple[str, ...]  # requests the caller must end (abort): their lost KV fits nowhere
    segments: dict[str, tuple[Segment, ...]]  # request id -> its segments that were on the instance


@dataclass(frozen=True)
class Recovered:
    """A request whose lost KV is recomputed: it decodes again from here."""

    request_id: str
    num_segments: int  # lost segments recomputed
    num_tokens: int  # tokens recomputed
    seconds: float  # from the loss to the last recompute chunk's end


@dataclass
class _Recovery:
    started_at: float  # time.monotonic()
    num_segments: int
    num_tokens: int


@dataclass
class _RequestState:
    detokenizer: IncrementalDetokenizer
    pending_text: str = ""  # decoded, not handed out yet: it may start a stop string
    text_pieces: list[str] = field(default_factory=list)  # the text handed out, a piece a step


class LLMEngine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig(),
                 remote: RemoteAttention | None = None, lender: KVLender | None = None) -> None:
        """Args:
            checkpoint: the loaded model.
            config: the engine's settings.
            remote: attention over segments on other instances; default: the in-process pools
                of ``config.pool_blocks[1:]``.
            lender: moves KV blocks to peer instances (a daemon); then the engine spills and
                frees remote segments through it instead of through in-process pools.
        """
        self.config = config
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # CUDA's current device is per thread, and graph capture and Triton launches use it:
            # the thread that builds the engine (and captures its graphs) works on its device.
            torch.cuda.set_device(self.device)
        if config.dtype == "auto":
            self.dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            self.dtype = _DTYPES[config.dtype]
        limit = checkpoint.config.max_position
        self.max_model_len = min(config.max_model_len, limit) if config.max_model_len else limit
        self.model = LlamaModel(checkpoint.config, checkpoint.weights, device=self.device, dtype=self.dtype,
                                max_position=self.max_model_len)
        mc = checkpoint.config
        self.pools = [
            allocate_kv_pool(KVPoolShape(n, mc.num_layers, config.block_size, mc.num_kv_heads, mc.head_dim),
                             self.dtype, self.device)
            for n in config.pool_blocks
        ]
        self.home_instance_id = config.home_instance_id
        self.lender = lender
        self.block_manager = BlockManager(config.block_size, config.pool_blocks, self.home_instance_id,
                                          on_remote_free=lender.release if lender is not None else None)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   can_start=self._prompt_fits_free_memory if lender is not None else None,
                                   queue_bypass_limit=config.queue_bypass_limit,
                                   split_decode_interval=config.split_decode_interval)
        creditors = {i: p for i, p in enumerate(self.pools) if i != self.home_instance_id}
        self.remote = remote if remote is not None else InProcessRemoteAttention(creditors, num_heads=mc.num_heads)
        self.sampler = Sampler()
        self.decode_graphs: PiecewiseDecodeGraphs | None = None
        self.local_decode_graphs: LocalDecodeGraphs | None = None
        self.split_decode_graphs: SplitDecodeGraphs | None = None
        # Decode steps with remote parts that ran layer by layer (not as one split graph).
        self.split_decode_steps_by_layer = 0
        if self.device.type == "cuda" and config.cuda_graphs:
            sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b < config.max_num_seqs) + (config.max_num_seqs,)
            self.decode_graphs = PiecewiseDecodeGraphs(self.model, sizes)
            # One home block is never given to a request: padded rows of graph steps write there.
            (padding_block,) = self.block_manager.reserve_home_blocks(1)
            self.local_decode_graphs = LocalDecodeGraphs(
                self.model, self.pools[self.home_instance_id], padding_block * config.block_size, sizes,
                -(-self.max_model_len // config.block_size))
            self.split_decode_graphs = SplitDecodeGraphs(
                self.model, self.pools[self.home_instance_id], padding_block * config.block_size, sizes,
                -(-self.max_model_len // config.block_size))
        self._states: dict[str, _RequestState] = {}
        # Requests whose outputs ``stream`` or ``generate`` waits for: each step's, and an
        # abort's, are queued here for their caller whoever stepped the engine.
        self._collected: dict[str, deque[RequestOutput]] = {}
        self._ids = itertools.count()
        self._step_ids = itertools.count()
        self.last_step_id = -1  # the id of the last step run
        self._block_arrays = BlockIdArrays()  # the segments' block ids as arrays, kept across steps
        self._loop: asyncio.AbstractEventLoop | None = None
        # Next-token logits ([vocab] float32) of each request sampled in the last step.
        self.last_step_logits: dict[str, torch.Tensor] = {}
        self._recoveries: dict[str, _Recovery] = {}
        self.recovered: deque[Recovered] = deque()  # recoveries done, for the caller to take

    @classmethod
    def from_path(cls, path: str | None = None, config: EngineConfig = EngineConfig(), *,
                  show_progress: bool = True) -> "LLMEngine":
        """Load a GGUF file or Hugging Face folder (None: the embedded SmolLM2) and build an engine."""
        return cls(load_checkpoint(path, show_progress=show_progress), config)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int] | Sequence[ChatMessage | dict[str, str]],
                    params: SamplingParams = SamplingParams(), request_id: str | None = None) -> str:
        """Queue a request: a text prompt, token ids, or chat messages (rendered with the template)."""
        if not isinstance(params, SamplingParams):
            raise RequestRejected(f"params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.prompt_token_ids(prompt)
        if not token_ids:
            raise RequestRejected("the prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:  # first: the check over every id below is longer
            raise RequestRejected(
                f"the prompt has {len(token_ids)} tokens; the model's context is {self.max_model_len} tokens "
                "and at least one must be left for the output"
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        # Output stops at the context's end anyway; what must fit is the KV of the longest run,
        # less its last token: sampled at the end, it is never fed back, so never written.
        most_written = min(len(token_ids) + params.max_tokens, self.max_model_len) - 1
        blocks = -(-most_written // self.config.block_size)
        capacity = self.block_manager.num_total_blocks() if self.config.spill_to_creditors and len(self.pools) > 1 \
            else self.block_manager.num_total_blocks(self.home_instance_id)
        if self.lender is not None:
            capacity += self.lender.num_blocks_elsewhere()
        if self.local_decode_graphs is not None:
            capacity -= 1  # the padding block of graph steps
        if blocks > capacity:
            raise RequestRejected(
                f"the request needs KV for up to {most_written} tokens = {blocks} KV blocks, but the pools hold "
                f"{capacity} blocks in all; lower max_tokens or the prompt"
            )
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self._states:
            raise RequestRejected(f"request id {request_id!r} is already in use")
        self.scheduler.add(Request(request_id, token_ids, params))
        self._states[request_id] = _RequestState(IncrementalDetokenizer(self.tokenizer))
        return request_id

    def add_prefilled_request(self, token_ids: Sequence[int], params: SamplingParams, request_id: str,
                              segments: Sequence[Segment], num_computed_tokens: int) -> str:
        """Queue a request whose first ``num_computed_tokens`` tokens have their K and V written
        already, in ``segments`` (``BlockManager.adopt``: an APB prefill's chunks, on peers and
        in the home pool). The scheduler computes the rest (the query) over them as a prefill
        chunk, then decodes. If it is ever preempted, its blocks are freed and it recomputes
        its whole prompt exactly, as any preempted request does.

        Raises RequestRejected as ``add_request`` does; ValueError for segments that do not
        cover exactly the computed tokens (then nothing is kept)."""
        if not 0 < num_computed_tokens < len(token_ids):
            raise ValueError(f"num_computed_tokens must leave at least one of the {len(token_ids)} tokens to compute, "
                             f"got {num_computed_tokens}")
        if segments and segments[-1].token_end != num_computed_tokens:
            raise ValueError(f"the segments cover {segments[-1].token_end} tokens, not the {num_computed_tokens} "
                             "computed")
        request_id = self.add_request(list(token_ids), params, request_id=request_id)
        request = self.scheduler.requests[request_id]
        try:
            self.block_manager.adopt(request_id, segments)
        except ValueError:
            self.scheduler.requests.pop(request_id)
            self.scheduler.waiting.remove(request)
            self._states.pop(request_id, None)
            raise
        request.num_computed_tokens = num_computed_tokens
        return request_id

    def prompt_token_ids(self, prompt: object) -> list[int]:
        """The token ids of a prompt as ``add_request`` takes it; RequestRejected where it is none
        of its forms. Reads no engine state: a server may call it on a thread of its own (a long
        prompt takes seconds to tokenize) and pass the ids to ``add_request``."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            # Iterating bytes gives ints: undecoded text would pass as token ids.
            raise RequestRejected("a prompt is a string, a list of token ids or a list of chat messages; "
                                  "decode bytes to a string first")
        try:
            items = list(prompt)  # type: ignore[call-overload]
        except TypeError:
            items = None
        if items and all(isinstance(m, (ChatMessage, dict)) for m in items):
            from jinja2 import TemplateError

            try:
                text = self.tokenizer.apply_chat_template(items)
            except (ValueError, TypeError, KeyError, TemplateError) as exc:
                # No template, or one that refuses these messages (roles out of its order).
                raise RequestRejected(f"the chat template cannot render these messages: {exc}") from None
            return self.tokenizer.encode(text, add_special_tokens=False)
        if items is not None and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
            return list(items)
        raise RequestRejected("a prompt is a string, a list of token ids or a list of chat messages")

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request wherever it is (waiting, mid-prefill, decoding) and free its KV.
        Returns its last output (finish reason "abort"), or None for a request not here; a
        ``stream`` or ``generate`` waiting on it receives that output and ends."""
        request = self.scheduler.requests.get(request_id)
        state = self._states.pop(request_id, None)
        self._recoveries.pop(request_id, None)
        if request is not None:
            self.scheduler.finish(request_id)
            if self.lender is not None:
                self.lender.forget(request_id)
        self.sampler.forget(request_id)
        if request is None or state is None:
            return None
        output = RequestOutput(request_id, (), "", len(request.output_token_ids), True, "abort",
                               request.output_token_ids, state.text_pieces, len(state.text_pieces))
        collected = self._collected.get(request_id)
        if collected is not None:
            collected.append(output)
        return output

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def placement(self, request_id: str) -> tuple[Segment, ...]:
        """Where the request's KV lives: its segments in token order."""
        return self.block_manager.block_table(request_id)

    # ---- moving KV -----------------------------------------------------------------------
    def lend(self, request_id: str, num_blocks: int, dst_instance_id: int) -> SegmentMove:
        """Move the request's oldest ``num_blocks`` home blocks to a creditor pool (at a step boundary)."""
        written = self.scheduler.requests[request_id].num_computed_tokens
        move = self.block_manager.lend(request_id, num_blocks, dst_instance_id, written)
        return self._copy_and_commit(move)

    def take_back(self, request_id: str, segment_index: int) -> SegmentMove:
        """Bring a lent segment's KV back into the home pool."""
        return self._copy_and_commit(self.block_manager.take_back(request_id, segment_index))

    def _copy_and_commit(self, move: SegmentMove) -> SegmentMove:
        src = torch.tensor(move.src_block_ids, device=self.device)
        dst = torch.tensor(move.dst_block_ids, device=self.device)
        self.pools[move.dst_instance_id][dst] = self.pools[move.src_instance_id][src]
        self.block_manager.commit_move(move)
        return move

    # ---- a lost instance -----------------------------------------------------------------
    def recover_lost(self, instance_id: int, blocks_elsewhere: int | None = None) -> LostKV:
        """The instance ``instance_id`` (a creditor pool) is lost with the KV it held: the
        running requests with segments there recompute those tokens, from their token ids, in
        chunks that attend over the KV that survived (at home and on other creditors), before
        they decode again. Requests whose lost KV the cluster cannot hold are returned to be
        ended: more lost blocks than are free at home and ``blocks_elsewhere`` (the other
        creditors' free blocks; default: the in-process pools'), the ones with the most lost
        first. Called between steps."""
        if instance_id == self.home_instance_id:
            raise ValueError("the home instance cannot be lost to itself")
        bm = self.block_manager
        lost = bm.drop_instance(instance_id)
        if not lost:
            return LostKV({}, (), {})
        if blocks_elsewhere is None:
            blocks_elsewhere = sum(bm.num_free_blocks(i) for i in bm.instance_ids
                                   if i not in (self.home_instance_id, instance_id))
        room = bm.num_free_blocks(self.home_instance_id) + blocks_elsewhere
        unrecoverable = []
        for request_id in sorted(lost, key=lambda r: (bm.num_lost_blocks(r), r)):
            need = bm.num_lost_blocks(request_id)
            if need > room:
                unrecoverable.append(request_id)
            else:
                room -= need
        now = time.monotonic()
        recomputing = {}
        for request_id, segments in lost.items():
            if request_id in unrecoverable:
                continue
            num_tokens = sum(s.num_tokens for s in segments)
            recomputing[request_id] = num_tokens
            previous = self._recoveries.get(request_id)  # lost again while recomputing: one recovery
            self._recoveries[request_id] = _Recovery(
                previous.started_at if previous else now,
                (previous.num_segments if previous else 0) + len(segments),
                (previous.num_tokens if previous else 0) + num_tokens)
        return LostKV(recomputing, tuple(unrecoverable), {r: tuple(segments) for r, segments in lost.items()})

    def _prompt_fits_free_memory(self, request: Request) -> bool:
        """With peers: a waiting request starts only when its whole context fits the home's free
        blocks (less those other homes' starting requests count on) and the blocks peers keep for
        it. Started on less, two long requests that together exceed the cluster would each take
        part of it, then preempt and recompute themselves over and over while the other holds
        what they need; counted on the peers' published free blocks alone, two homes would both
        count on the same ones."""
        bm = self.block_manager
        need = bm.blocks_needed(request.request_id, request.num_tokens)
        home_free = (bm.num_free_blocks(self.home_instance_id) - self.lender.num_home_blocks_kept_for_others()
                     - self.home_blocks_promised())
        if need <= home_free:
            return True
        # What the home lacks must be kept for this request by peers: their published free
        # blocks are a figure other homes count on too.
        return self.lender.blocks_kept_elsewhere(request.request_id, need - home_free) >= need - home_free

    def home_blocks_promised(self) -> int:
        """Free home blocks that the running requests' prefills still count on: the blocks their
        known tokens still need (the prompt, and after a preemption the outputs recomputed with
        it), less what peers keep for them (their spills' share)."""
        if self.lender is None:
            return 0
        bm = self.block_manager
        promised = 0
        for r in self.scheduler.running:
            if r.is_prefilling or bm.has_lost(r.request_id):
                rest = bm.blocks_needed(r.request_id, r.num_tokens) + bm.num_lost_blocks(r.request_id)
                promised += max(0, rest - self.lender.blocks_kept_elsewhere(r.request_id, 0))
        return promised

    def home_shortfall(self) -> int:
        """Home blocks missing for the next step's new tokens (0: enough are free)."""
        return max(0, self.home_blocks_wanted() - self.block_manager.num_free_blocks(self.home_instance_id))

    def home_blocks_wanted(self) -> int:
        """Free home blocks the next step may need: a block per running request and a chunk."""
        bm = self.block_manager
        running = self.scheduler.running
        head = self.scheduler.waiting[0] if self.scheduler.waiting else None
        # A block per running request (a decode may open one), and a whole chunk while a prompt
        # is being prefilled, or recomputed with its outputs after a preemption, or a lost range
        # of its KV recomputed.
        wanted = len(running) + 1
        if any(r.is_prefilling or bm.has_lost(r.request_id) for r in running):
            wanted += -(-self.config.max_num_batched_tokens // self.config.block_size)
        if head is not None:
            wanted = max(wanted, len(running) + bm.blocks_needed(head.request_id, head.num_computed_tokens + min(
                head.num_tokens - head.num_computed_tokens, self.config.max_num_batched_tokens)))
        return wanted

    def num_written_tokens(self) -> dict[str, int]:
        """Tokens with K and V written, per running request: only their full blocks may move."""
        return {r.request_id: r.num_computed_tokens for r in self.scheduler.running}

    def _spill(self) -> None:
        """Lend old blocks to in-process creditor pools so that the home keeps room for the next step."""
        bm = self.block_manager
        shortfall = self.home_shortfall()
        if shortfall <= 0:
            return
        written = self.num_written_tokens()
        for request_id, num_blocks, dst in bm.plan_spill(shortfall, written):
            self.lend(request_id, num_blocks, dst)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns what each scheduled request produced."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(self.step_async())

    async def step_async(self) -> list[RequestOutput]:
        """One iteration inside a running event loop: schedule, run, postprocess."""
        if self.lender is not None:
            shortfall = self.home_shortfall()
            if shortfall > 0:
                await self.lender.spill(self, shortfall)
        elif self.config.spill_to_creditors and len(self.pools) > 1:
            self._spill()
        scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            if (self.scheduler.running or self.scheduler.waiting) and self.lender is None:
                raise RuntimeError("no request can be scheduled: the home pool has no room for one token of any")
            # With peers, blocks come back when their requests finish or they free segments:
            # the caller steps again later.
            return []
        sampled = await self._run(scheduled)
        return self._postprocess(scheduled, sampled)

    async def _run(self, scheduled: SchedulerOutput) -> list[int]:
        """Run the model over the step's chunks; return one sampled token per sampling chunk."""
        requests = self.scheduler.requests
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        for chunk in scheduled.chunks:
            request = requests[chunk.request_id]
            end = chunk.start + chunk.num_tokens
            if not chunk.recomputes and self.block_manager.has_lost(chunk.request_id):
                raise RuntimeError(f"request {chunk.request_id} was scheduled past its lost KV, which it "
                                   "must recompute first")
            token_ids += request.token_ids_between(chunk.start, end)
            positions += range(chunk.start, end)
            slots += self.block_manager.slot_mapping(chunk.request_id, chunk.start, end)
            if chunk.samples:
                logits_rows.append(len(token_ids) - 1)
        step_id = self.last_step_id = next(self._step_ids)
        layout = build_step_attention(
            step_id, scheduled.chunks, {c.request_id: self.block_manager.block_table(c.request_id) for c in scheduled.chunks},
            slots, home_instance_id=self.home_instance_id, block_size=self.config.block_size, device=self.device,
            block_arrays=self._block_arrays,
        )
        ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        decode = all(c.num_tokens == 1 for c in scheduled.chunks)
        home_batch = layout.batches[self.home_instance_id]
        if (decode and self.local_decode_graphs is not None and len(layout.batches) == 1
                and layout.placements[self.home_instance_id].identity and home_batch.q_pos is None
                and self.local_decode_graphs.can_run(len(token_ids), home_batch.block_tables.shape[1])):
            # Every key is in the home pool: the whole step, attention included, is one graph.
            logits = self.local_decode_graphs.forward(ids, pos, layout.slot_mapping, home_batch.block_tables,
                                                      home_batch.kv_lens, rows)
            self.remote.end_step(step_id)
        elif (device_parts := self._begin_device_step(decode, layout)) is not None:
            # Every creditor of the step takes it on the device: the whole step, remote parts
            # included, is one graph.
            remote_ids = [i for i in layout.batches if i != self.home_instance_id]
            try:
                await self.remote.device_step_ready(step_id)
                logits = self.split_decode_graphs.forward(ids, pos, layout, self.home_instance_id, remote_ids,
                                                          device_parts, rows)
            except BaseException:
                self.remote.abandon_step(step_id)
                raise
            finally:
                self.remote.end_step(step_id)
        else:
            if decode and len(layout.batches) > 1:
                self.split_decode_steps_by_layer += 1
            # Planned only here: the whole-step graph above reads the layout's tables itself.
            attention = DistAttention(layout, self.pools[self.home_instance_id], self.home_instance_id, self.remote,
                                      num_heads=self.model_config.num_heads, sm_scale=self.model.sm_scale)
            forward = self.model.forward
            if decode and self.decode_graphs is not None and self.decode_graphs.can_run(len(token_ids)):
                forward = self.decode_graphs.forward
            try:
                logits = await forward(ids, pos, attention, rows)
            except BaseException:
                self.remote.abandon_step(step_id)
                raise
            finally:
                self.remote.end_step(step_id)
        try:
            await self._until_device_done(step_id)
            await self.remote.finish_step(step_id)
        except BaseException:
            self.remote.abandon_step(step_id)
            raise
        return self._sample(scheduled, logits)

    def _begin_device_step(self, decode: bool, layout: StepAttention) -> list[DevicePart] | None:
        """A split decode step begun with creditors that all take it on the device (their
        parts, in the layout's order of instances), or None: the step goes layer by layer."""
        graphs = self.split_decode_graphs
        if not decode or graphs is None or len(layout.batches) == 1 or not graphs.can_run(layout, self.home_instance_id):
            return None
        graphs.forget_parts(self.remote.live_device_parts())
        remote_ids = [i for i in layout.batches if i != self.home_instance_id]
        max_rows = self.remote.device_part_rows
        wire_rows = None if max_rows is None else graphs.wire_rows(layout, self.home_instance_id, remote_ids, max_rows)
        return self.remote.begin_device_step([layout.batches[i] for i in remote_ids], wire_rows)

    async def _until_device_done(self, step_id: int) -> None:
        """Let the event loop turn while the device runs the step's queued kernels, instead of
        blocking in the sampler's copy to the host: a daemon serves its peers' attend requests
        (on a stream of their own) and its clients meanwhile. A step whose remote parts are
        queued on the device (stream waits for a creditor's mailbox) is watched: past the
        remote's ``step_timeout_s`` its waits are released (the step then fails in
        ``finish_step``) rather than leave the device waiting for a creditor that is gone."""
        if self.device.type != "cuda":
            return
        done = torch.cuda.Event()
        done.record()
        timeout_s = self.remote.step_timeout_s
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not done.query():
            if deadline is not None and (time.monotonic() >= deadline or self.remote.step_failed(step_id)):
                self.remote.release_step(step_id)
                deadline = None
            await asyncio.sleep(0)

    def _sample(self, scheduled: SchedulerOutput, logits: torch.Tensor) -> list[int]:
        """logits ``[num_sampling_chunks, vocab]`` -> one token per sampling chunk."""
        requests = self.scheduler.requests
        sampling = [c for c in scheduled.chunks if c.samples]
        self.last_step_logits = {c.request_id: row for c, row in zip(sampling, logits)}
        return self.sampler.sample(logits, [c.request_id for c in sampling],
                                   [requests[c.request_id].params for c in sampling])

    def _postprocess(self, scheduled: SchedulerOutput, sampled: list[int]) -> list[RequestOutput]:
        outputs = []
        tokens = iter(sampled)
        for chunk in scheduled.chunks:
            request = self.scheduler.requests[chunk.request_id]
            if chunk.recomputes:
                self._recomputed(chunk.request_id)
                continue
            request.num_computed_tokens = chunk.start + chunk.num_tokens
            if not chunk.samples:
                continue
            if chunk.request_id in self._recoveries:  # preempted while recomputing: all of it was again
                self._recomputed(chunk.request_id)
            token = next(tokens)
            request.output_token_ids.append(token)
            output = self._advance(request, token)
            outputs.append(output)
            collected = self._collected.get(output.request_id)
            if collected is not None:
                collected.append(output)
        return outputs

    def _recomputed(self, request_id: str) -> None:
        """A recompute chunk of the request ran: once no lost range is left, its recovery is done."""
        if self.block_manager.has_lost(request_id):
            return
        recovery = self._recoveries.pop(request_id, None)
        if recovery is not None:
            self.recovered.append(Recovered(request_id, recovery.num_segments, recovery.num_tokens,
                                            time.monotonic() - recovery.started_at))

    def _advance(self, request: Request, token: int) -> RequestOutput:
        """Append one token to the request's text and decide whether it is done."""
        state = self._states[request.request_id]
        params = request.params
        reason = None
        stopping_token = (not params.ignore_eos and token in self.tokenizer.eos_token_ids) or token in params.stop_token_ids
        if stopping_token:
            reason = "stop"
        else:
            state.pending_text += state.detokenizer.add([token])
        pending = state.pending_text
        if params.stop and reason is None:
            # Only the text not handed out yet is searched: the last (longest stop - 1)
            # characters are held back, so a stop string that this token completes starts there.
            hits = [i for i in (pending.find(s) for s in params.stop) if i >= 0]
            if hits:
                pending = pending[: min(hits)]
                reason = "stop"
        if reason is None and (len(request.output_token_ids) >= params.max_tokens or request.num_tokens >= self.max_model_len):
            reason = "length"
            # A character the output ends inside of, as the full decode renders it.
            pending += state.detokenizer.flush()
        finished = reason is not None
        if finished:
            new_text, state.pending_text = pending, ""
        else:
            # Hold back text that might be the start of a stop string.
            holdback = max((len(s) for s in params.stop), default=1) - 1
            visible = max(0, len(pending) - holdback)
            new_text, state.pending_text = pending[:visible], pending[visible:]
        if new_text:
            state.text_pieces.append(new_text)
        output = RequestOutput(request.request_id, (token,), new_text, len(request.output_token_ids), finished,
                               reason, request.output_token_ids, state.text_pieces, len(state.text_pieces))
        if finished:
            self.scheduler.finish(request.request_id)
            if self.lender is not None:
                self.lender.forget(request.request_id)
            self.sampler.forget(request.request_id)
            del self._states[request.request_id]
        return output

    # ---- conveniences --------------------------------------------------------------------
    def generate(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[RequestOutput]:
        """Run prompts to completion together; the final output of each, in order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise RequestRejected(f"{len(prompts)} prompts but {len(params_list)} sampling params: give one "
                                  "for all or one per prompt")
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params_list):
                ids.append(self.add_request(prompt, sp))  # a refused prompt ends the call: see finally
                self._collected[ids[-1]] = deque()
            final: dict[str, RequestOutput] = {}
            while len(final) < len(ids):
                self._step_for(ids)
                for request_id in ids:
                    for output in _drain(self._collected[request_id]):
                        if output.finished:
                            final[request_id] = output
            return [final[i] for i in ids]
        finally:
            self._forget_collected(ids)

    def stream(self, prompt: str | Sequence[int], params: SamplingParams = SamplingParams()) -> Iterator[RequestOutput]:
        """Yield the request's outputs as they are made (other queued requests run too). Another
        ``stream`` or ``generate`` may step the engine between two of them: each gets its own
        request's outputs. Closing the iterator before the end aborts the request."""
        request_id = self.add_request(prompt, params)
        collected = self._collected[request_id] = deque()
        try:
            while True:
                if not collected:
                    self._step_for([request_id])
                while collected:
                    output = collected.popleft()
                    yield output
                    if output.finished:
                        return
        finally:
            self._forget_collected([request_id])

    def _step_for(self, request_ids: list[str]) -> None:
        """One step on behalf of callers waiting on ``request_ids`` (whose outputs go to their
        queues). A request that has ended gets its last output already (``abort``), so an engine
        with nothing left to run while one is still awaited is a bug, not a wait."""
        if not self.has_unfinished and not any(self._collected.get(i) for i in request_ids):
            raise RuntimeError(f"requests {request_ids} are awaited but the engine has nothing to run")
        self.step()

    def _forget_collected(self, request_ids: list[str]) -> None:
        """Stop collecting outputs for these requests; those not finished are aborted (their
        caller is gone: nobody would read them)."""
        for request_id in request_ids:
            self._collected.pop(request_id, None)
            if request_id in self._states:
                self.abort(request_id)


def _drain(queue: deque) -> Iterator:
    while queue:
        yield queue.popleft()
