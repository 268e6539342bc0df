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
