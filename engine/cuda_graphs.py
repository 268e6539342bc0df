"""Decode steps replayed as CUDA graphs, captured piecewise around attention.

A decode step launches a few dozen small kernels per layer; at small batch their launch cost,
not the GPU, sets the step time. The dense part between two attentions (output projection, MLP,
the next layer's norm, q/k/v projection and RoPE) is the same sequence of kernels every step,
so it is captured once per batch size as one graph. Attention stays outside the graphs: it
reads block tables that change every step and awaits the parts of creditors, which a graph
cannot do.

Per step: ``num_layers + 1`` graph replays and ``num_layers`` eager attention calls. Batches are
padded to the next captured size; padded rows carry token 0 at position 0, never reach the KV
pool (attention sees only the real rows) and their outputs are dropped.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

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
from infinite_llm.transport import graph_capture

from .dist_attention import StepAttention

from .model import AttentionFn, LlamaModel

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64)


@dataclass
class _Buffers:
    """The static tensors one batch size's graphs read and write."""

    token_ids: torch.Tensor  # [batch] int64
    positions: torch.Tensor  # [batch] int64
    hidden: list[torch.Tensor]  # per layer: the residual stream entering it, [batch, hidden]
    q: list[torch.Tensor]  # per layer: [batch, num_heads, head_dim]
    k: list[torch.Tensor]  # per layer: [batch, num_kv_heads, head_dim]
    v: list[torch.Tensor]  # per layer: [batch, num_kv_heads, head_dim]
    attn_out: torch.Tensor  # [batch, num_heads, head_dim], written by the eager attention
    logits: torch.Tensor  # [batch, vocab] float32


class PiecewiseDecodeGraphs:
    """CUDA graphs of a model's decode step for a set of batch sizes."""

    def __init__(self, model: LlamaModel, batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        if not batch_sizes or any(b <= 0 for b in batch_sizes):
            raise ValueError(f"batch_sizes must be positive, got {batch_sizes}")
        self.model = model
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._buffers: dict[int, _Buffers] = {}
        # Largest first: the later, smaller captures reuse the memory of the pool.
        for batch in reversed(self.batch_sizes):
            self._capture(batch)

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def _pieces(self, b: _Buffers):
        """The functions captured: piece 0 embeds and projects layer 0; piece i finishes layer
        i - 1 and projects layer i; the last finishes the last layer and computes logits."""
        model = self.model
        num_layers = model.config.num_layers

        def first() -> None:
            b.hidden[0].copy_(model.embed(b.token_ids))
            q, k, v = model.pre_attention(0, b.hidden[0], b.positions)
            b.q[0].copy_(q), b.k[0].copy_(k), b.v[0].copy_(v)

        def middle(layer: int):
            def run() -> None:
                hidden = model.post_attention(layer - 1, b.hidden[layer - 1], b.attn_out)
                b.hidden[layer].copy_(hidden)
                q, k, v = model.pre_attention(layer, hidden, b.positions)
                b.q[layer].copy_(q), b.k[layer].copy_(k), b.v[layer].copy_(v)
            return run

        def last() -> None:
            hidden = model.post_attention(num_layers - 1, b.hidden[num_layers - 1], b.attn_out)
            b.logits.copy_(model.logits(hidden))

        return [first] + [middle(layer) for layer in range(1, num_layers)] + [last]

    def _capture(self, batch: int) -> None:
        model, c = self.model, self.model.config
        dev, dt = model.device, model.dtype
        b = _Buffers(
            token_ids=torch.zeros(batch, dtype=torch.int64, device=dev),
            positions=torch.zeros(batch, dtype=torch.int64, device=dev),
            hidden=[torch.zeros(batch, c.hidden_size, dtype=dt, device=dev) for _ in range(c.num_layers)],
            q=[torch.zeros(batch, c.num_heads, c.head_dim, dtype=dt, device=dev) for _ in range(c.num_layers)],
            k=[torch.zeros(batch, c.num_kv_heads, c.head_dim, dtype=dt, device=dev) for _ in range(c.num_layers)],
            v=[torch.zeros(batch, c.num_kv_heads, c.head_dim, dtype=dt, device=dev) for _ in range(c.num_layers)],
            attn_out=torch.zeros(batch, c.num_heads, c.head_dim, dtype=dt, device=dev),
            logits=torch.zeros(batch, c.vocab_size, dtype=torch.float32, device=dev),
        )
        pieces = self._pieces(b)
        # Warm up on a side stream (lazy initialisations must not land in the graph).
        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            for piece in pieces:
                piece()
        torch.cuda.current_stream(dev).wait_stream(stream)
        graphs = []
        for piece in pieces:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                piece()
            graphs.append(graph)
        torch.cuda.synchronize(dev)
        self._graphs[batch] = graphs
        self._buffers[batch] = b

    def can_run(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_batch_size

    async def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                      logits_rows: torch.Tensor) -> torch.Tensor:
        """The same contract as :meth:`LlamaModel.forward`, for decode batches (one token each).

        Args:
            token_ids, positions: ``[num_tokens]`` int64 on the model's device.
            attention: the step's attention over the real rows.
            logits_rows: ``[num_rows]`` int64.

        Returns:
            ``[num_rows, vocab]`` float32 logits.
        """
        n = token_ids.shape[0]
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        b, graphs = self._buffers[batch], self._graphs[batch]
        b.token_ids[:n].copy_(token_ids)
        b.positions[:n].copy_(positions)
        if n < batch:
            b.token_ids[n:].zero_()
            b.positions[n:].zero_()
            b.attn_out[n:].zero_()
        graphs[0].replay()
        for layer in range(self.model.config.num_layers):
            out = await attention(layer, b.q[layer][:n], b.k[layer][:n], b.v[layer][:n])
            b.attn_out[:n].copy_(out)
            graphs[layer + 1].replay()
        return b.logits[logits_rows].clone()


@dataclass
class _StepBuffers:
    """The static inputs and outputs of one (batch, table width) whole-step graph."""

    token_ids: torch.Tensor  # [batch] int64
    positions: torch.Tensor  # [batch] int64
    slot_mapping: torch.Tensor  # [batch] int64; padded rows write into the padding slot
    block_tables: torch.Tensor  # [batch, width] int32
    kv_lens: torch.Tensor  # [batch] int32; 0 for padded rows
    logits: torch.Tensor  # [batch, vocab] float32
    graph: torch.cuda.CUDAGraph
    plan: MicroAttentionPlan  # the graph reads its tensors: kept alive with it


class LocalDecodeGraphs:
    """Whole decode steps, attention included, for steps whose KV is all in the home pool.

    With no remote part to await, nothing in a decode step changes but the values of a few
    small tensors (token ids, positions, slots, block tables, lengths), so the step is one graph
    per batch size and block-table width (16, 24, 32, 48, 64, ... blocks). Padded rows attend over no key and
    write their K/V into a block reserved for that (``padding_slot``). Graphs are captured on
    first use of a shape.
    """

    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, padding_slot: int,
                 batch_sizes: tuple[int, ...], max_blocks_per_seq: int) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.padding_slot = padding_slot
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_size = kv_pool.shape[3]
        # Table widths a graph is captured for: 16, 24, 32, 48, 64, ... blocks. The kernel's key
        # splits are planned for the width, so a step wastes at most a third of its programs.
        widths = []
        for exponent in range(4, max(4, (max_blocks_per_seq - 1).bit_length()) + 1):
            widths += [1 << exponent, 3 << (exponent - 1)]
        self.widths = tuple(w for w in widths if w < 2 * max(16, max_blocks_per_seq))
        self._pool = torch.cuda.graph_pool_handle()
        self._steps: dict[tuple[int, int], _StepBuffers] = {}

    def can_run(self, num_rows: int, max_blocks: int) -> bool:
        return 0 < num_rows <= self.batch_sizes[-1] and max_blocks <= self.widths[-1]

    def _capture(self, batch: int, width: int) -> _StepBuffers:
        model, c, dev = self.model, self.model.config, self.model.device
        bt = torch.zeros(batch, width, dtype=torch.int32, device=dev)
        kv_lens = torch.zeros(batch, dtype=torch.int32, device=dev)
        token_ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        positions = torch.zeros(batch, dtype=torch.int64, device=dev)
        slots = torch.full((batch,), self.padding_slot, dtype=torch.int64, device=dev)
        logits = torch.zeros(batch, c.vocab_size, dtype=torch.float32, device=dev)
        plan = plan_micro_attention(
            bt, kv_lens, torch.arange(batch + 1, dtype=torch.int32, device=dev),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=self.block_size,
            num_blocks=self.kv_pool.shape[0], max_query_len=1, max_kv_len=width * self.block_size, check_bounds=False)

        def step() -> None:
            hidden = model.embed(token_ids)
            for layer in range(c.num_layers):
                q, k, v = model.pre_attention(layer, hidden, positions)
                write_kv(k, v, self.kv_pool, layer, slots, check_bounds=False)
                out = run_micro_attention(plan, q, self.kv_pool, layer, sm_scale=model.sm_scale, out_dtype=q.dtype).out
                hidden = model.post_attention(layer, hidden, out)
            logits.copy_(model.logits(hidden))

        stream = torch.cuda.Stream(device=dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            step()  # compiles the kernels outside the capture
        torch.cuda.current_stream(dev).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            step()
        torch.cuda.synchronize(dev)
        return _StepBuffers(token_ids, positions, slots, bt, kv_lens, logits, graph, plan)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                block_tables: torch.Tensor, kv_lens: torch.Tensor, logits_rows: torch.Tensor) -> torch.Tensor:
        """One decode step: row i attends over ``kv_lens[i]`` keys in ``block_tables[i]``.

        Args:
            token_ids, positions, slot_mapping: ``[num_rows]`` int64.
            block_tables: ``[num_rows, num_blocks]`` int32; kv_lens ``[num_rows]`` int32 (the
                new token included).
            logits_rows: ``[num_sampled]`` int64.

        Returns:
            ``[num_sampled, vocab]`` float32 logits.
        """
        n, w = block_tables.shape
        batch = self.batch_sizes[bisect.bisect_left(self.batch_sizes, n)]
        width = self.widths[bisect.bisect_left(self.widths, w)]
        key = (batch, width)
        if key not in self._steps:
            self._steps[key] = self._capture(batch, width)
        b = self._steps[key]
        b.token_ids[:n].copy_(token_ids)
        b.positions[:n].copy_(positions)
        b.slot_mapping[:n].copy_(slot_mapping)
        b.block_tables[:n, :w].copy_(block_tables)
        b.kv_lens[:n].copy_(kv_lens)
        if n < batch:
            b.slot_mapping[n:].fill_(self.padding_slot)
            b.kv_lens[n:].zero_()
        b.graph.replay()
        return b.logits[logits_rows].clone()


# Entries an instance's part of a split step may have, as captured (more: the step goes eagerly).
ENTRY_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# Split-step graphs kept at once; the least recently replayed goes first.
MAX_SPLIT_GRAPHS = 24


def _size_for(n: int, sizes: tuple[int, ...]) -> int | None:
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


@dataclass
class _PartRows:
    """Where one instance's entries come from and go to in a split step: entry e attends for
    token row ``gather[e]`` and its result is part ``parts[e]`` of row ``scatter[e]``. Padded
    entries gather row 0 and scatter into the spare row (``batch``), which nothing reads."""

    num_entries: int  # as captured (the real ones first)
    gather: torch.Tensor  # [num_entries] int64
    scatter: torch.Tensor  # [num_entries] int64
    parts: torch.Tensor  # [num_entries] int64


@dataclass
class _SplitStep:
    """The static inputs and outputs of one split-step graph, and what it reads."""

    token_ids: torch.Tensor  # [batch] int64
    positions: torch.Tensor  # [batch] int64
    slot_mapping: torch.Tensor  # [batch] int64; padded rows write into the padding slot
    home_tables: torch.Tensor  # [home entries, width] int32
    home_lens: torch.Tensor  # [home entries] int32; 0 for padded entries
    home: _PartRows
    remote: list[_PartRows]  # per device part, in the key's order
    aligned: bool  # every row: one part here and one on each creditor, in row order (any order of age)
    logits: torch.Tensor  # [batch, vocab] float32
    graph: torch.cuda.CUDAGraph | None  # None: the step runs eagerly (``run``)
    plan: MicroAttentionPlan  # the graph reads its tensors: kept alive with it
    device_parts: list  # [DevicePart]: their memory stays mapped while the graph may run
    run: Callable[[bool], None]  # the step's body; ``run(live=True)`` is what the graph holds
    last_used: int = 0


class SplitDecodeGraphs:
    """Whole decode steps whose KV is partly on creditors that take the step on the device.

    A creditor with a device mailbox (``DevicePart``) is told once per step what to attend over
    (``RemoteAttention.begin_device_step``); then, per layer, the query rows are copied into its
    mailbox and announced, and the home's stream waits for the part, all on the stream. With
    no host work between layers, the step is one graph, remote parts included, as a local step
    is (``LocalDecodeGraphs``): per batch size, home block-table width, entries per instance,
    parts per row and device parts (a graph reads the mailboxes' memory: one whose part is no
    longer live is dropped). The home's own part, the creditors' parts and the merge are those
    of ``DistAttention``; padded rows and entries attend over nothing here and their results
    land in a spare row.
    """

    def __init__(self, model: LlamaModel, kv_pool: torch.Tensor, padding_slot: int,
                 batch_sizes: tuple[int, ...], max_blocks_per_seq: int, *, use_graphs: bool = True,
                 max_graphs: int = MAX_SPLIT_GRAPHS) -> None:
        if use_graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self.model = model
        self.kv_pool = kv_pool
        self.padding_slot = padding_slot
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_size = kv_pool.shape[3]
        self.use_graphs = use_graphs
        self.max_graphs = max_graphs
        widths = []
        for exponent in range(4, max(4, (max_blocks_per_seq - 1).bit_length()) + 1):
            widths += [1 << exponent, 3 << (exponent - 1)]
        self.widths = tuple(w for w in widths if w < 2 * max(16, max_blocks_per_seq))
        self._pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self._steps: dict[tuple, _SplitStep] = {}
        self._uses = 0
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0  # steps run without a graph (``use_graphs=False``)

    def can_run(self, step: StepAttention, home_instance_id: int) -> bool:
        """Whether ``step`` (a decode step: one query row per entry, no causal mask) fits a
        captured shape; its remote parts are asked for separately."""
        if step.num_tokens > self.batch_sizes[-1]:
            return False
        for instance_id, batch in step.batches.items():
            if batch.q_pos is not None or batch.max_query_len != 1:
                return False
            if _size_for(batch.num_entries, ENTRY_SIZES) is None:
                return False
        return step.batches[home_instance_id].block_tables.shape[1] <= self.widths[-1]

    def wire_rows(self, step: StepAttention, home_instance_id: int, remote_ids: list[int], max_rows: int) -> list[int]:
        """Per remote part (in ``remote_ids``' order), the rows the step's graph writes and
        reads of it, each layer: its rows padded to the graph's shape."""
        _, _, remote_entries = self._rows(step, home_instance_id, remote_ids, [max_rows] * len(remote_ids))
        return list(remote_entries)

    def _rows(self, step: StepAttention, home_instance_id: int, remote_ids: list[int],
              max_rows: list[int]) -> tuple[bool, int, tuple[int, ...]]:
        """(aligned, home entries, remote entries) of the graph for ``step``."""
        n = step.num_tokens
        batch = _size_for(n, self.batch_sizes)
        home_batch = step.batches[home_instance_id]
        # The common split: every row has one part here and one on each creditor (one request,
        # or requests split alike). Its parts merge two at a time, where they lie, with no
        # gather or scatter (the merge is the same whichever holds the older keys).
        places = [step.placements[i] for i in (home_instance_id, *remote_ids)]
        aligned = (len(places) > 1 and step.num_parts == len(places) and all(place.all_rows for place in places)
                   and sorted(place.part for place in places if place.part is not None) == list(range(len(places)))
                   and all(batch <= rows for rows in max_rows))
        if aligned:
            return True, batch, (batch,) * len(remote_ids)
        return False, _size_for(home_batch.num_entries, ENTRY_SIZES), tuple(
            min(_size_for(step.batches[i].num_entries, ENTRY_SIZES), rows) for i, rows in zip(remote_ids, max_rows))

    def _key(self, step: StepAttention, home_instance_id: int, remote_ids: list[int],
             device_parts: list) -> tuple:
        batch = _size_for(step.num_tokens, self.batch_sizes)
        width = _size_for(step.batches[home_instance_id].block_tables.shape[1], self.widths)
        aligned, home_entries, remote_entries = self._rows(step, home_instance_id, remote_ids,
                                                           [part.max_rows for part in device_parts])
        return (batch, width, home_entries, step.num_parts, aligned,
                tuple((part.key, entries) for part, entries in zip(device_parts, remote_entries)))

    def _capture(self, key: tuple, device_parts: list) -> _SplitStep:
        batch, width, home_entries, num_parts, aligned, remote_key = key
        model, c, dev = self.model, self.model.config, self.model.device
        pool = self.kv_pool

        def rows(entries: int) -> _PartRows:
            return _PartRows(entries, torch.zeros(entries, dtype=torch.int64, device=dev),
                             torch.full((entries,), batch, dtype=torch.int64, device=dev),
                             torch.zeros(entries, dtype=torch.int64, device=dev))

        home = rows(home_entries)
        remote = [rows(entries) for _, entries in remote_key]
        home_tables = torch.zeros(home_entries, width, dtype=torch.int32, device=dev)
        home_lens = torch.zeros(home_entries, dtype=torch.int32, device=dev)
        token_ids = torch.zeros(batch, dtype=torch.int64, device=dev)
        positions = torch.zeros(batch, dtype=torch.int64, device=dev)
        slots = torch.full((batch,), self.padding_slot, dtype=torch.int64, device=dev)
        logits = torch.zeros(batch, c.vocab_size, dtype=torch.float32, device=dev)
        plan = plan_micro_attention(
            home_tables, home_lens, torch.arange(home_entries + 1, dtype=torch.int32, device=dev),
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, block_size=self.block_size,
            num_blocks=pool.shape[0], max_query_len=1, max_kv_len=width * self.block_size,
            check_bounds=dev.type != "cuda")
        # The merge's parts: one row more than the batch, where padded entries' results land.
        out_parts = torch.zeros(num_parts, batch + 1, c.num_heads, c.head_dim, dtype=torch.float32, device=dev)
        lse_parts = torch.zeros(num_parts, batch + 1, c.num_heads, dtype=torch.float32, device=dev)

        def step(live: bool) -> None:
            hidden = model.embed(token_ids)
            for layer in range(c.num_layers):
                q, k, v = model.pre_attention(layer, hidden, positions)
                # The creditors' queries first: their attention starts while this stream writes
                # the new keys (which only the home's own part reads) and attends here.
                for part, part_rows in zip(device_parts, remote):
                    if aligned:
                        part.q[layer, :batch].copy_(q)
                    else:
                        part.q[layer, :part_rows.num_entries].copy_(q.index_select(0, part_rows.gather))
                    if live:
                        part.announce_query(layer, part_rows.num_entries)
                write_kv(k, v, pool, layer, slots, check_bounds=dev.type != "cuda")
                local = run_micro_attention(plan, q if aligned else q.index_select(0, home.gather), pool, layer,
                                            sm_scale=model.sm_scale, out_dtype=torch.float32)
                if aligned:
                    merged = local
                    for i, part in enumerate(device_parts):
                        if live:
                            part.await_result(layer, batch)
                        last = i == len(device_parts) - 1
                        merged = merge_two_attention_states(
                            merged, AttentionState(part.out[layer, :batch], part.lse[layer, :batch]),
                            out_dtype=q.dtype if last else torch.float32, with_lse=not last)
                    out = merged
                else:
                    out_parts.zero_()
                    lse_parts.fill_(float("-inf"))
                    out_parts[home.parts, home.scatter] = local.out
                    lse_parts[home.parts, home.scatter] = local.lse
                    for part, part_rows in zip(device_parts, remote):
                        entries = part_rows.num_entries
                        if live:
                            part.await_result(layer, entries)
                        out_parts[part_rows.parts, part_rows.scatter] = part.out[layer, :entries].float()
                        lse_parts[part_rows.parts, part_rows.scatter] = part.lse[layer, :entries]
                    out = merge_attention_states(out_parts, lse_parts, out_dtype=q.dtype).out[:batch]
                hidden = model.post_attention(layer, hidden, out)
            logits.copy_(model.logits(hidden))

        if self.use_graphs:
            # Every earlier graph may be gone (dropped with its mailboxes, or evicted).
            self._pool = graph_capture.pool_for_capture(self._pool, held=bool(self._steps))
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream(device=dev)
            stream.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(stream):
                # Once without the mailboxes' flags, so that every kernel is loaded and compiled
                # outside the capture (its rows are padding: only the padding slot is written),
                # and the host waits for this stream alone: the device may be running a
                # creditor's step for another home, waiting on that home's queries.
                step(live=False)
                stream.synchronize()
                graph_capture.capture(graph, self._pool, lambda: step(live=True))
            torch.cuda.current_stream(dev).wait_stream(stream)
            self.captures += 1
        else:
            graph = None
        return _SplitStep(token_ids, positions, slots, home_tables, home_lens, home, remote, aligned,
                          logits, graph, plan, list(device_parts), step)

    def forget_parts(self, live_keys: set) -> None:
        """Drop the graphs over a device part that is no longer live (its memory may be gone)."""
        for key in [k for k in self._steps if any(part_key not in live_keys for part_key, _ in k[-1])]:
            del self._steps[key]

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, step: StepAttention, home_instance_id: int,
                remote_ids: list[int], device_parts: list, logits_rows: torch.Tensor) -> torch.Tensor:
        """One decode step of ``step``'s layout, the parts of ``remote_ids`` (begun with their
        creditors) through ``device_parts``, in that order.

        Args:
            token_ids, positions: ``[num_rows]`` int64.
            logits_rows: ``[num_sampled]`` int64.

        Returns:
            ``[num_sampled, vocab]`` float32 logits.
        """
        key = self._key(step, home_instance_id, remote_ids, device_parts)
        captured = self._steps.get(key)
        if captured is None:
            while len(self._steps) >= self.max_graphs:
                del self._steps[min(self._steps, key=lambda k: self._steps[k].last_used)]
            captured = self._steps[key] = self._capture(key, device_parts)
        self._uses += 1
        captured.last_used = self._uses
        n = step.num_tokens
        batch = captured.token_ids.shape[0]
        captured.token_ids[:n].copy_(token_ids)
        captured.positions[:n].copy_(positions)
        captured.slot_mapping[:n].copy_(step.slot_mapping)
        if n < batch:
            captured.token_ids[n:].zero_()
            captured.positions[n:].zero_()
            captured.slot_mapping[n:].fill_(self.padding_slot)
        home_batch = step.batches[home_instance_id]
        entries, width = home_batch.block_tables.shape
        captured.home_tables[:entries, :width].copy_(home_batch.block_tables)
        captured.home_lens[:entries].copy_(home_batch.kv_lens)
        captured.home_lens[entries:].zero_()
        if not captured.aligned:
            for instance_id, part_rows in [(home_instance_id, captured.home), *zip(remote_ids, captured.remote)]:
                placement, e = step.placements[instance_id], step.batches[instance_id].num_entries
                part_rows.gather[:e].copy_(placement.rows)
                part_rows.scatter[:e].copy_(placement.rows)
                part_rows.parts[:e].copy_(placement.parts)
                if e < part_rows.num_entries:
                    part_rows.gather[e:].zero_()
                    part_rows.scatter[e:].fill_(batch)
                    part_rows.parts[e:].zero_()
        if captured.graph is not None:
            captured.graph.replay()
            self.replays += 1
        else:
            captured.run(True)
            self.eager_steps += 1
        return captured.logits[logits_rows].clone()
