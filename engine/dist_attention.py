"""DistAttention on the home instance: local MicroAttention, remote parts, exact merge.

Each step, :func:`build_step_attention` turns the scheduled chunks and the block tables into
one :class:`AttendBatch` per instance holding segments of the batch's requests (the home
included). A segment is one "sequence" of the MicroAttention kernel: its query rows are the
rows of the request's chunk, its keys the segment's tokens, placed by ``kv_start_pos`` so that
the causal mask holds across segments. Per layer, :class:`DistAttention` writes the new K and V
into the home pool, sends one :meth:`RemoteAttention.attend` per remote instance (all of them in
flight together), computes the local part meanwhile, awaits the rest and merges every part of a
row with :func:`merge_attention_states`.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Hashable
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from infinite_llm.kernels import (
    AttentionState,
    MicroAttentionPlan,
    merge_attention_states,
    merge_two_attention_states,
    plan_micro_attention,
    run_micro_attention,
    write_kv,
)
from infinite_llm.kernels.reference import (
    DecodeGather,
    decode_attention_torch,
    is_decode_batch,
    plan_decode_gather,
    split_slots,
    write_kv_at_torch,
)

from .block_manager import Segment
from .scheduler import ScheduledChunk


@dataclass(frozen=True)
class AttendBatch:
    """One step's attention work on one instance; the same for every layer of the step.

    Entry ``e`` is one segment of one request: query rows
    ``[query_start_loc[e], query_start_loc[e + 1])`` of the q sent with each call attend to the
    ``kv_lens[e]`` keys in ``block_tables[e]``, the first of which is at ``kv_start_pos[e]``.
    All tensors are int32 on the home's device.
    """

    step_id: int
    instance_id: int
    block_tables: torch.Tensor  # [num_entries, max_blocks_per_entry]
    kv_lens: torch.Tensor  # [num_entries]
    kv_start_pos: torch.Tensor  # [num_entries]
    query_start_loc: torch.Tensor  # [num_entries + 1]
    q_pos: torch.Tensor | None  # [num_entry_rows] absolute query positions; None: every key is older
    max_query_len: int
    max_kv_len: int
    entry_keys: tuple[tuple[str, int], ...] = ()  # per entry: (request id, the segment's token_start)
    # per entry, on the host: (its first query row, its rows, its keys), as the tensors above say
    entry_rows: tuple[tuple[int, int, int], ...] = ()

    @property
    def num_entries(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_rows(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def num_rows_host(self) -> int:
        """``num_rows`` from the host copy of the layout (no read of the device's tensors)."""
        first, rows, _ = self.entry_rows[-1]
        return first + rows


class RemoteAttention(abc.ABC):
    """Partial attention over the blocks another instance holds (the creditor side of a step).

    One call per remote instance per layer, batched over every request with segments there.
    Implementations: :class:`InProcessRemoteAttention` (pools in this process); a transport
    sends the batch's metadata once per step and q per layer.
    """

    @abc.abstractmethod
    async def attend(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> AttentionState:
        """Args: q ``[batch.num_rows, num_heads, head_dim]``.

        Returns: ``AttentionState(out [num_rows, num_heads, head_dim] float32, lse [num_rows,
        num_heads] float32 natural log)``, one row per query row of the batch.
        """

    def start(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> Awaitable[AttentionState]:
        """``attend``, begun now: an implementation that can send the request before returning
        lets the other instance compute while this one computes its own part. By default a
        task, which starts at the step's next await."""
        return asyncio.ensure_future(self.attend(batch, layer, q, sm_scale))

    def end_step(self, step_id: int) -> None:
        """The step is over: drop whatever was kept for it."""

    # A step's parts may be queued on the device rather than awaited (a creditor's mailbox):
    # the engine then watches the step's device work for this long, s (None: no deadline).
    step_timeout_s: float | None = None

    async def finish_step(self, step_id: int) -> None:
        """After the step's device work is done: raise where a queued part did not come (the
        step's outputs are then not used)."""

    def release_step(self, step_id: int) -> bool:
        """The step's device work outlived ``step_timeout_s``: end whatever device waits its
        parts queued, so the device goes on (the step then fails in ``finish_step``). True
        where there were any."""
        return False

    def step_failed(self, step_id: int) -> bool:
        """Whether a queued part of the step is known lost already (its device waits are then
        released at once rather than at ``step_timeout_s``)."""
        return False

    def abandon_step(self, step_id: int) -> None:
        """The step failed before ``finish_step``: let go of what its queued parts hold."""

    # The rows a device part holds per layer (DevicePart.max_rows), None where there are none.
    device_part_rows: int | None = None

    def begin_device_step(self, batches: Sequence[AttendBatch],
                          wire_rows: Sequence[int] | None = None) -> list[DevicePart] | None:
        """Where every batch's creditor takes this step's layers on the device (a mailbox the
        home's stream writes and waits on): the step begun with each of them and their parts, in
        the order of ``batches``. None, and nothing begun, where any of them cannot (the step
        then goes layer by layer through ``start``). ``wire_rows``: per batch, the rows the
        step's graph writes and reads of its part (its rows padded)."""
        return None

    async def device_step_ready(self, step_id: int) -> None:
        """After ``begin_device_step``, before the step's first query is written: whatever the
        creditors must have answered first (a creditor with another step queued ahead). Raises
        as ``finish_step`` does."""

    def live_device_parts(self) -> set[Hashable]:
        """The ``key`` of every device part that may still be given out: a graph captured over
        a part whose key is not here reads memory that is gone, and is dropped."""
        return set()


class DevicePart(abc.ABC):
    """A creditor's part of a decode step queued on the home's stream, capturable in a graph.

    Per layer: the rows of the query written into ``q[layer, :rows]``, ``announce_query``;
    later ``await_result`` and the part read from ``out[layer, :rows]`` and
    ``lse[layer, :rows]``. ``rows`` is the graph's (the step's rows padded, the same every
    layer, as ``wire_rows`` of ``begin_device_step`` said); the creditor attends for the rows
    its ``StepBegin`` named, the batch's entries in order, and what the padding rows hold is not
    read. The tensors stay where they are while ``key`` is live.
    """

    key: Hashable  # unique for the life of the memory below
    q: torch.Tensor  # [num_layers, max_rows, num_heads, head_dim], the step's dtype
    out: torch.Tensor  # [num_layers, max_rows, num_heads, head_dim], the step's dtype
    lse: torch.Tensor  # [num_layers, max_rows, num_heads] float32, natural log

    @property
    def max_rows(self) -> int:
        return self.q.shape[1]

    @abc.abstractmethod
    def announce_query(self, layer: int, rows: int) -> None:
        """Queue on the current stream: the layer's ``rows`` query rows are there."""

    @abc.abstractmethod
    def await_result(self, layer: int, rows: int) -> None:
        """Queue on the current stream: wait for the layer's part (``rows`` rows), then mark
        it taken."""


class InProcessRemoteAttention(RemoteAttention):
    """Creditor pools living in this process (tests, the single-machine demo)."""

    def __init__(self, pools: Mapping[int, torch.Tensor], *, num_heads: int) -> None:
        self._pools = pools
        self._num_heads = num_heads
        self._plans: dict[tuple[int, int], MicroAttentionPlan] = {}
        self.num_calls = 0  # attend calls served: tests count one per instance per layer

    async def attend(self, batch: AttendBatch, layer: int, q: torch.Tensor, sm_scale: float) -> AttentionState:
        pool = self._pools[batch.instance_id]
        key = (batch.step_id, batch.instance_id)
        if key not in self._plans:
            self._plans[key] = _plan(batch, pool, self._num_heads)
        self.num_calls += 1
        return run_micro_attention(self._plans[key], q, pool, layer, sm_scale=sm_scale, out_dtype=torch.float32)

    def end_step(self, step_id: int) -> None:
        for key in [k for k in self._plans if k[0] == step_id]:
            del self._plans[key]


def _plan(batch: AttendBatch, pool: torch.Tensor, num_heads: int) -> MicroAttentionPlan:
    num_blocks, _, _, block_size, num_kv_heads, head_dim = pool.shape
    return plan_micro_attention(
        batch.block_tables, batch.kv_lens, batch.query_start_loc,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        block_size=block_size, num_blocks=num_blocks,
        kv_start_pos=batch.kv_start_pos if batch.q_pos is not None else None, q_pos=batch.q_pos,
        max_query_len=batch.max_query_len, max_kv_len=batch.max_kv_len,
        check_bounds=pool.device.type != "cuda",  # on CUDA the check would sync every step
    )


@dataclass(frozen=True)
class _Placement:
    """Where an instance's result rows go in the merge: part ``part`` of token row ``row``."""

    rows: torch.Tensor  # [num_entry_rows] int64, token rows of the step
    parts: torch.Tensor  # [num_entry_rows] int64
    identity: bool  # rows == arange(num_tokens) and parts == 0: the state is used as it is
    all_rows: bool  # rows == arange(num_tokens): the instance attends for every row, in order
    part: int | None  # the part of every row, where they share one


@dataclass(frozen=True)
class StepAttention:
    """The step's attention layout, built once and used by every layer."""

    step_id: int
    num_tokens: int
    num_parts: int  # most parts any token row merges (1: nothing to merge)
    slot_mapping: torch.Tensor  # [num_tokens] int64 home slots of the new K/V
    batches: dict[int, AttendBatch]  # instance id -> its work
    placements: dict[int, _Placement]


class BlockIdArrays:
    """Segments' block ids as int32 arrays, kept from one step to the next.

    A step's block tables are built from its requests' segments; a long request's home segment
    holds thousands of block ids, and turning that tuple into a tensor every step (about 0.6 ms
    for 7,500 ids on the development CPU) would cost a decode step more than its kernels. A
    segment's ``block_ids`` tuple is the same object until the segment gains a block (every
    ``block_size`` tokens of a decode), so its array is made once and found again by identity.
    Arrays no step asked for since the last ``end_step`` are dropped then.
    """

    def __init__(self) -> None:
        self._kept: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
        self._used: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}

    def of(self, block_ids: tuple[int, ...]) -> np.ndarray:
        """``block_ids`` as a read-only int32 array."""
        key = id(block_ids)
        entry = self._used.get(key) or self._kept.get(key)
        if entry is None or entry[0] is not block_ids:  # the tuple holds its id while it is kept
            array = np.array(block_ids, dtype=np.int32)
            array.flags.writeable = False
            entry = (block_ids, array)
        self._used[key] = entry
        return entry[1]

    def end_step(self) -> None:
        self._kept, self._used = self._used, {}


def table_rows(rows: list[list[np.ndarray]], width: int | None = None) -> np.ndarray:
    """``[len(rows), width]`` int32 (None: the widest row's), row ``i`` the pieces of
    ``rows[i]`` in order, 0-padded."""
    widths = [sum(len(piece) for piece in pieces) for pieces in rows]
    table = np.zeros((len(rows), max(widths) if width is None else width), dtype=np.int32)
    for i, pieces in enumerate(rows):
        if len(pieces) == 1:
            table[i, :widths[i]] = pieces[0]
        else:
            np.concatenate(pieces, out=table[i, :widths[i]])
    return table


def build_step_attention(
    step_id: int,
    chunks: Sequence[ScheduledChunk],
    block_tables: Mapping[str, Sequence[Segment]],
    slot_mapping: Sequence[int],
    *,
    home_instance_id: int,
    block_size: int,
    device: torch.device,
    block_arrays: BlockIdArrays | None = None,
) -> StepAttention:
    """Lay out one step's attention over the segments of each chunk's request.

    ``block_arrays``: where the segments' block ids are kept as arrays across steps (the engine
    keeps one; ``end_step`` is called here); without it they are made for this step alone.
    """
    arrays = block_arrays if block_arrays is not None else BlockIdArrays()
    # instance id -> entries [row, num_rows, first q position, block id pieces (arrays), kv_start_pos,
    # num_keys, part, request id]
    entries: dict[int, list[list]] = {}
    num_parts = 1
    row = 0
    for chunk in chunks:
        end = chunk.start + chunk.num_tokens
        part = 0
        previous: Segment | None = None
        for segment in block_tables[chunk.request_id]:
            num_keys = min(segment.token_end, end) - segment.token_start
            if num_keys <= 0:
                continue
            used_blocks = arrays.of(segment.block_ids)[: -(-num_keys // block_size)]
            if (previous is not None and previous.instance_id == segment.instance_id
                    and previous.token_end == segment.token_start
                    and previous.token_end - previous.token_start == len(previous.block_ids) * block_size):
                # Consecutive segments on one instance (a long prompt spills a piece per chunk,
                # KV moved while decoding arrives a piece per move): one entry over their blocks
                # in order, so the instance attends for the row once and the row merges one part
                # per instance, not one per segment. A creditor reads such an entry across the
                # segments it holds (``CreditorAttention``). The pieces are joined once, below:
                # hundreds of pieces join in time linear in their blocks.
                entry = entries[segment.instance_id][-1]
                entry[3].append(used_blocks)
                entry[5] += num_keys
            else:
                entries.setdefault(segment.instance_id, []).append(
                    [row, chunk.num_tokens, chunk.start, [used_blocks], segment.token_start, num_keys, part,
                     chunk.request_id]
                )
                part += 1
            previous = segment
        num_parts = max(num_parts, part)
        row += chunk.num_tokens
    num_tokens = row
    arrays.end_step()

    batches: dict[int, AttendBatch] = {}
    placements: dict[int, _Placement] = {}
    # The layout is made in numpy and handed to torch at the end: a step of a few entries would
    # otherwise spend more in the dispatch of a few dozen tiny torch ops than in its kernels.
    for instance_id, rows in entries.items():
        q_lens = np.array([e[1] for e in rows], dtype=np.int64)
        starts = np.zeros(len(rows) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=starts[1:])
        q_pos = np.concatenate([np.arange(e[2], e[2] + e[1], dtype=np.int32) for e in rows])
        token_rows = np.concatenate([np.arange(e[0], e[0] + e[1], dtype=np.int64) for e in rows])
        entry_parts = [e[6] for e in rows]
        parts = np.repeat(np.array(entry_parts, dtype=np.int64), q_lens)
        # Segments whose keys all precede their queries (lent, older blocks) need no mask.
        causal = any(e[4] + e[5] - 1 > e[2] for e in rows)
        all_rows = len(token_rows) == num_tokens and bool((token_rows == np.arange(num_tokens)).all())
        identity = num_parts == 1 and all_rows
        shared_part = entry_parts[0] if all(p == entry_parts[0] for p in entry_parts) else None
        kv_lens = [e[5] for e in rows]
        batches[instance_id] = AttendBatch(
            step_id=step_id,
            instance_id=instance_id,
            block_tables=torch.from_numpy(table_rows([e[3] for e in rows])).to(device),
            kv_lens=torch.from_numpy(np.array(kv_lens, dtype=np.int32)).to(device),
            kv_start_pos=torch.from_numpy(np.array([e[4] for e in rows], dtype=np.int32)).to(device),
            query_start_loc=torch.from_numpy(starts).to(device),
            q_pos=torch.from_numpy(q_pos).to(device) if causal else None,
            max_query_len=int(q_lens.max()),
            max_kv_len=max(kv_lens),
            entry_keys=tuple((e[7], e[4]) for e in rows),
            entry_rows=tuple((int(first), e[1], e[5]) for first, e in zip(starts, rows)),
        )
        placements[instance_id] = _Placement(torch.from_numpy(token_rows).to(device),
                                             torch.from_numpy(parts).to(device), identity, all_rows, shared_part)
    if home_instance_id not in batches:
        raise ValueError("every chunk must have its newest tokens on the home instance")
    return StepAttention(
        step_id=step_id,
        num_tokens=num_tokens,
        num_parts=num_parts,
        slot_mapping=torch.from_numpy(np.array(slot_mapping, dtype=np.int64)).to(device),
        batches=batches,
        placements=placements,
    )


class DistAttention:
    """The per-layer attention of one step on the home instance (an ``AttentionFn``)."""

    def __init__(self, step: StepAttention, home_pool: torch.Tensor, home_instance_id: int,
                 remote: RemoteAttention | None, *, num_heads: int, sm_scale: float) -> None:
        self.step = step
        self.home_pool = home_pool
        self.home_instance_id = home_instance_id
        self.remote = remote
        self.sm_scale = sm_scale
        home_batch = step.batches[home_instance_id]
        self.local_plan = _plan(home_batch, home_pool, num_heads)
        self.remote_ids = [i for i in step.batches if i != home_instance_id]
        if self.remote_ids and remote is None:
            raise ValueError(f"the step attends over instances {self.remote_ids} but no RemoteAttention was given")
        # On the CPU the per-layer work of the torch path is a few dozen small ops: what every
        # layer would rebuild (the write slots' blocks and offsets; for a decode step with all its
        # keys here, the gather of the keys and its mask) is built once per step instead.
        self._write_at: tuple[torch.Tensor, torch.Tensor] | None = None
        self._local_decode: DecodeGather | None = None
        if home_pool.device.type == "cpu":
            self._write_at = split_slots(step.slot_mapping, home_pool.shape[3])
            if (not self.remote_ids and step.placements[home_instance_id].identity and is_decode_batch(
                    home_batch.query_start_loc.tolist(), home_batch.kv_lens.tolist(), home_batch.q_pos)):
                self._local_decode = plan_decode_gather(home_batch.block_tables, home_batch.kv_lens,
                                                        home_pool.shape[3], home_batch.max_kv_len)

    def _rows(self, q: torch.Tensor, instance_id: int) -> torch.Tensor:
        placement = self.step.placements[instance_id]
        return q if placement.all_rows else q.index_select(0, placement.rows)

    async def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self._write_at is not None:
            write_kv_at_torch(k, v, self.home_pool, layer, *self._write_at)
        else:
            write_kv(k, v, self.home_pool, layer, self.step.slot_mapping, check_bounds=False)
        if self._local_decode is not None:
            out, _ = decode_attention_torch(q, self.home_pool, layer, self._local_decode, self.sm_scale, q.dtype)
            return out
        pending = [
            self.remote.start(self.step.batches[i], layer, self._rows(q, i), self.sm_scale)
            for i in self.remote_ids
        ]
        home = self.home_instance_id
        simple = not pending and self.step.placements[home].identity
        try:
            local = run_micro_attention(
                self.local_plan, self._rows(q, home), self.home_pool, layer,
                sm_scale=self.sm_scale, out_dtype=q.dtype if simple else torch.float32,
            )
        except BaseException:
            for part in pending:  # started but never to be awaited
                part.close() if asyncio.iscoroutine(part) else part.cancel()
            raise
        if simple:
            return local.out
        parts = []
        try:
            # Awaited one by one, as they are: all were started above, so this takes as long as
            # the slowest, and gather would put a future of its own between each part and this
            # step (one more turn of the event loop on the home's critical path at every
            # layer). A part queued on the device (a mailbox's) returns without suspending.
            for part in pending:
                parts.append(await part)
        except BaseException:
            # One part failed: the others are not awaited by anyone else, so they are ended
            # here and their outcomes retrieved.
            for part in pending[len(parts) + 1:]:
                if asyncio.iscoroutine(part):
                    part.close()
                else:
                    part.cancel()
            await asyncio.gather(*[p for p in pending[len(parts) + 1:] if not asyncio.iscoroutine(p)],
                                 return_exceptions=True)
            raise
        states = dict(zip(self.remote_ids, parts))
        states[home] = local
        return self._merge(states, q)

    def _merge(self, states: dict[int, AttentionState], q: torch.Tensor) -> torch.Tensor:
        if len(states) == 2 and self.step.num_parts == 2:
            # The common split decode: every row has one part here and one on a creditor. Merged
            # where the two lie, in one launch (the general path below zero-fills, scatters and
            # merges: seven launches, a home's critical path after every remote part).
            by_part = {self.step.placements[i].part: state for i, state in states.items()
                       if self.step.placements[i].all_rows}
            if by_part.keys() == {0, 1}:
                return merge_two_attention_states(by_part[0], by_part[1], out_dtype=q.dtype)
        num_tokens, num_heads, head_dim = q.shape
        out_parts = torch.zeros(self.step.num_parts, num_tokens, num_heads, head_dim, dtype=torch.float32, device=q.device)
        lse_parts = torch.full((self.step.num_parts, num_tokens, num_heads), float("-inf"), device=q.device)
        for instance_id, state in states.items():
            placement = self.step.placements[instance_id]
            out_parts[placement.parts, placement.rows] = state.out.float()
            lse_parts[placement.parts, placement.rows] = state.lse
        return merge_attention_states(out_parts, lse_parts, out_dtype=q.dtype).out
