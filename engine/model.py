"""A Llama-family decoder (Llama 2/3, SmolLM2, Qwen2) over paged KV.

The model owns the weights and the non-attention compute. Attention is handed to an
:class:`AttentionFn` per layer: it writes the new K and V, attends over the request's blocks
wherever they live and returns the merged output, possibly awaiting other instances. So the
forward pass is a coroutine, and its pieces between attention calls
(:meth:`LlamaModel.pre_attention`, :meth:`LlamaModel.post_attention`) are what a CUDA graph
captures.
"""

from __future__ import annotations

from typing import Awaitable, Protocol

import torch
import torch.nn.functional as F

from infinite_llm.kernels.layer_ops import add_rms_norm, rms_norm, silu_and_mul

from .config import ModelConfig
from .rope import RotaryEmbedding

__all__ = ["AttentionFn", "LlamaModel", "rms_norm"]


class AttentionFn(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Awaitable[torch.Tensor]:
        """q ``[num_tokens, num_heads, head_dim]``, k and v ``[num_tokens, num_kv_heads, head_dim]``
        -> attention output ``[num_tokens, num_heads, head_dim]`` in q's dtype."""
        ...


# On the CPU, the BLAS kernels for one or two rows read a weight stored [in, out] about 1.3x
# faster than one stored [out, in] (measured with MKL on AMD EPYC, float32, SmolLM2 shapes);
# from four rows on, [out, in] is the faster. Steps with at most this many rows use the
# [in, out] copies.
_CPU_FEW_ROWS = 2
# The copies double the weights' memory: kept only for models whose weights take at most this
# many bytes (SmolLM2-135M in float32: 0.54 GB), never for a large model served from the CPU.
_CPU_FEW_ROWS_MAX_WEIGHT_BYTES = 2 << 30
# For more than ``_CPU_FEW_ROWS`` rows, oneDNN's float32 matmul is 2.2x faster than MKL's, which
# ``F.linear`` calls on the CPU: 1.1 against 2.4 ms for a 256-row q/k/v projection (about 265
# against 120 GFLOP/s), 28 against 64 ms for gate/up at 2,048 rows (SmolLM2 shapes, one thread,
# the AMD EPYC above); from three rows on it is the faster. The same products and sums, equal to
# float32 rounding. A private op: without it (a torch built without oneDNN) every step uses
# ``F.linear``.
_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


class LlamaModel:
    """Weights on one device in one dtype, with q/k/v and gate/up fused into single matmuls.

    On the CPU every projection and the output head are also kept transposed, ``[in, out]``,
    for steps of at most ``_CPU_FEW_ROWS`` rows (decode at batch 1 and 2); that doubles the
    weights' memory, so only models of at most ``_CPU_FEW_ROWS_MAX_WEIGHT_BYTES`` get them.
    Steps of more rows (prefill, larger decode batches) run their float32 matmuls on oneDNN
    (:meth:`linear`).
    """

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, device: torch.device | str,
                 dtype: torch.dtype, max_position: int | None = None) -> None:
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed_tokens = put(weights["embed_tokens"])
        self.lm_head = self.embed_tokens if config.tie_word_embeddings else put(weights["lm_head"])
        self.norm = put(weights["norm"])
        self.layers: list[dict[str, torch.Tensor | None]] = []
        for i in range(config.num_layers):
            w = lambda name: weights[f"layers.{i}.{name}"]  # noqa: E731
            qkv_bias = None
            if config.attention_bias:
                qkv_bias = put(torch.cat([w("q_bias"), w("k_bias"), w("v_bias")]))
            self.layers.append(
                {
                    "input_norm": put(w("input_norm")),
                    "post_attention_norm": put(w("post_attention_norm")),
                    "qkv_proj": put(torch.cat([w("q_proj"), w("k_proj"), w("v_proj")])),  # [q + 2 kv, hidden]
                    "qkv_bias": qkv_bias,
                    "o_proj": put(w("o_proj")),
                    "gate_up_proj": put(torch.cat([w("gate_proj"), w("up_proj")])),  # [2 ffn, hidden]
                    "down_proj": put(w("down_proj")),
                }
            )
        # name -> the same weight stored [in, out], read as its transpose; CPU only.
        self.few_rows_layers: list[dict[str, torch.Tensor]] = []
        self.few_rows_lm_head: torch.Tensor | None = None
        weight_bytes = sum(t.numel() * t.element_size() for w in self.layers for t in w.values() if t is not None)
        weight_bytes += self.lm_head.numel() * self.lm_head.element_size()
        if self.device.type == "cpu" and weight_bytes <= _CPU_FEW_ROWS_MAX_WEIGHT_BYTES:
            def in_out(t: torch.Tensor) -> torch.Tensor:
                return t.t().contiguous().t()  # [out, in] values, [in, out] storage

            projections = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
            self.few_rows_layers = [{name: in_out(w[name]) for name in projections} for w in self.layers]
            self.few_rows_lm_head = in_out(self.lm_head)
        # Per layer, every weight a step of few rows reads: the norms and biases, the copies above.
        self._few_rows_weights = [{**w, **few} for w, few in zip(self.layers, self.few_rows_layers)]
        self.rope = RotaryEmbedding(
            config, max_position or config.max_position, self.device, dtype, weights.get("rope_freq_factors")
        )
        self.sm_scale = config.head_dim**-0.5
        self._onednn_linear = _ONEDNN_LINEAR is not None and self.device.type == "cpu" and dtype == torch.float32

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [rows, in]`` times ``weight [out, in]`` transposed, plus ``bias [out]`` -> ``[rows, out]``,
        with the CPU kernel that is the faster for that many rows (``F.linear`` elsewhere)."""
        if self._onednn_linear and x.shape[0] > _CPU_FEW_ROWS:
            return _ONEDNN_LINEAR(x, weight, bias, "none", [], "")
        return F.linear(x, weight, bias)

    def weights_for(self, layer: int, num_rows: int) -> dict[str, torch.Tensor | None]:
        """The layer's weights in the layout that is faster for a step of ``num_rows`` rows."""
        if num_rows <= _CPU_FEW_ROWS and self._few_rows_weights:
            return self._few_rows_weights[layer]
        return self.layers[layer]

    def lm_head_for(self, num_rows: int) -> torch.Tensor:
        """The output head ``[vocab, hidden]`` in the layout that is faster for ``num_rows`` rows."""
        if num_rows <= _CPU_FEW_ROWS and self.few_rows_lm_head is not None:
            return self.few_rows_lm_head
        return self.lm_head

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids ``[num_tokens]`` int64 -> hidden ``[num_tokens, hidden]``."""
        return F.embedding(token_ids, self.embed_tokens)

    def pre_attention(self, layer: int, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Norm, q/k/v projection and RoPE.

        Args:
            hidden: ``[num_tokens, hidden]``, the residual stream.
            positions: ``[num_tokens]`` int64.

        Returns:
            q ``[num_tokens, num_heads, head_dim]``, k and v ``[num_tokens, num_kv_heads, head_dim]``.
        """
        c = self.config
        w = self.weights_for(layer, hidden.shape[0])
        qkv = self.linear(rms_norm(hidden, w["input_norm"], c.rms_norm_eps), w["qkv_proj"], w["qkv_bias"])
        qk, v = qkv.split([c.q_size + c.kv_size, c.kv_size], dim=-1)
        # q and k heads rotate by the same angles: one RoPE over both gathers cos/sin once.
        qk = self.rope.apply(qk.view(-1, c.num_heads + c.num_kv_heads, c.head_dim), positions)
        q, k = qk.split([c.num_heads, c.num_kv_heads], dim=1)
        return q.contiguous(), k.contiguous(), v.reshape(-1, c.num_kv_heads, c.head_dim)

    def post_attention(self, layer: int, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Output projection, residual, norm, SwiGLU MLP, residual.

        Args:
            hidden: ``[num_tokens, hidden]``, the residual stream before this layer.
            attn_out: ``[num_tokens, num_heads, head_dim]``.

        Returns:
            The residual stream after this layer, ``[num_tokens, hidden]``.
        """
        c = self.config
        w = self.weights_for(layer, hidden.shape[0])
        # On CUDA the residual add and the norm are one kernel, and so are SiLU and the product
        # (a small decode step is launch-bound); on the CPU these are the torch references.
        normed, hidden = add_rms_norm(self.linear(attn_out.reshape(attn_out.shape[0], -1), w["o_proj"]), hidden,
                                      w["post_attention_norm"], c.rms_norm_eps)
        gate_up = self.linear(normed, w["gate_up_proj"])
        return hidden + self.linear(silu_and_mul(gate_up), w["down_proj"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden ``[num_rows, hidden]`` -> logits ``[num_rows, vocab]`` float32."""
        lm_head = self.lm_head_for(hidden.shape[0])
        return self.linear(rms_norm(hidden, self.norm, self.config.rms_norm_eps), lm_head).float()

    async def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn,
                      logits_rows: torch.Tensor) -> torch.Tensor:
        """One step over a flat batch of tokens.

        Args:
            token_ids, positions: ``[num_tokens]`` int64.
            attention: the step's attention (writes K/V, attends, merges remote parts).
            logits_rows: ``[num_rows]`` int64, the token rows whose next-token logits are wanted.

        Returns:
            ``[num_rows, vocab]`` float32 logits.
        """
        hidden = self.embed(token_ids)
        for layer in range(self.config.num_layers):
            q, k, v = self.pre_attention(layer, hidden, positions)
            attn_out = await attention(layer, q, k, v)
            hidden = self.post_attention(layer, hidden, attn_out)
        return self.logits(hidden[logits_rows])
