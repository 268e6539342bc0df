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
from dataclasses import dataclass

import torch

from infinite_llm.kernels import MicroAttentionPlan, plan_micro_attention, run_micro_attention, write_kv

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
