"""The CPU fast paths of the model and of DistAttention against plain references.

A tiny random Llama (two layers, GQA 4/2) checks the fused q/k/v and gate/up projections, the
one RoPE over q and k together and the transposed weights used for steps of one or two rows;
a NaN-poisoned pool checks the once-per-step decode gather of DistAttention.
"""

from __future__ import annotations

import asyncio
import math

import pytest
import torch
import torch.nn.functional as F

from infinite_llm.engine.block_manager import Segment
from infinite_llm.engine.config import ModelConfig
from infinite_llm.engine.dist_attention import DistAttention, build_step_attention
from infinite_llm.engine.model import LlamaModel, rms_norm
from infinite_llm.engine.scheduler import ScheduledChunk

CONFIG = ModelConfig(
    architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
    num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position=128, tie_word_embeddings=True,
)


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Unfused weights in the loader's naming, ``[out, in]`` each."""
    g = torch.Generator().manual_seed(seed)
    c = config
    weights = {"embed_tokens": torch.randn(c.vocab_size, c.hidden_size, generator=g),
               "norm": 1 + 0.1 * torch.randn(c.hidden_size, generator=g)}
    shapes = {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
              "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
              "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    for i in range(c.num_layers):
        for name, shape in shapes.items():
            weights[f"layers.{i}.{name}"] = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        for name in ("input_norm", "post_attention_norm"):
            weights[f"layers.{i}.{name}"] = 1 + 0.1 * torch.randn(c.hidden_size, generator=g)
    weights["lm_head"] = weights["embed_tokens"]
    return weights


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x [num_tokens, num_heads, head_dim]``, computed from scratch."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, x.shape[-1], 2).float() / x.shape[-1])
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


@pytest.fixture(scope="module")
def model_and_weights() -> tuple[LlamaModel, dict[str, torch.Tensor]]:
    weights = random_weights(CONFIG)
    return LlamaModel(CONFIG, weights, device="cpu", dtype=torch.float32), weights


@pytest.mark.parametrize("num_rows", [1, 2, 3, 9])
def test_fused_projections_match_the_unfused_layer(model_and_weights, num_rows: int) -> None:
    """pre_attention / post_attention / logits against F.linear on each unfused weight, for row
    counts on both sides of the CPU's transposed-weight threshold."""
    model, weights = model_and_weights
    c = CONFIG
    g = torch.Generator().manual_seed(num_rows)
    hidden = torch.randn(num_rows, c.hidden_size, generator=g)
    positions = torch.randint(0, c.max_position, (num_rows,), generator=g)
    w = lambda name: weights[f"layers.1.{name}"]  # noqa: E731

    x = rms_norm(hidden, w("input_norm"), c.rms_norm_eps)
    q_ref = rotate(F.linear(x, w("q_proj")).view(num_rows, c.num_heads, c.head_dim), positions, c.rope_theta)
    k_ref = rotate(F.linear(x, w("k_proj")).view(num_rows, c.num_kv_heads, c.head_dim), positions, c.rope_theta)
    v_ref = F.linear(x, w("v_proj")).view(num_rows, c.num_kv_heads, c.head_dim)
    q, k, v = model.pre_attention(1, hidden, positions)
    assert q.is_contiguous() and k.is_contiguous() and v.stride(-1) == 1
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    attn_out = torch.randn(num_rows, c.num_heads, c.head_dim, generator=g)
    mid = hidden + F.linear(attn_out.reshape(num_rows, -1), w("o_proj"))
    y = rms_norm(mid, w("post_attention_norm"), c.rms_norm_eps)
    want = mid + F.linear(F.silu(F.linear(y, w("gate_proj"))) * F.linear(y, w("up_proj")), w("down_proj"))
    torch.testing.assert_close(model.post_attention(1, hidden, attn_out), want, atol=1e-5, rtol=1e-5)

    want_logits = F.linear(rms_norm(hidden, weights["norm"], c.rms_norm_eps), weights["lm_head"])
    torch.testing.assert_close(model.logits(hidden), want_logits, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 37])
def test_linear_matches_f_linear_for_every_row_count(model_and_weights, num_rows: int) -> None:
    """The model's matmul (MKL for one or two rows, oneDNN for more on the CPU) against F.linear,
    with and without a bias, on a row-strided input as well."""
    model, _ = model_and_weights
    g = torch.Generator().manual_seed(num_rows)
    weight = torch.randn(40, CONFIG.hidden_size, generator=g)
    bias = torch.randn(40, generator=g)
    x = torch.randn(num_rows, 2 * CONFIG.hidden_size, generator=g)[:, : CONFIG.hidden_size]
    for b in (None, bias):
        torch.testing.assert_close(model.linear(x, weight, b), F.linear(x, weight, b), atol=1e-5, rtol=1e-5)


def test_transposed_copies_hold_the_same_weights(model_and_weights) -> None:
    model, _ = model_and_weights
    assert len(model.few_rows_layers) == CONFIG.num_layers
    for layer, few_rows in zip(model.layers, model.few_rows_layers):
        for name, t in few_rows.items():
            assert torch.equal(t, layer[name]) and t.t().is_contiguous()
    assert torch.equal(model.few_rows_lm_head, model.lm_head)


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """q ``[num_heads, head_dim]`` over k, v ``[num_keys, num_kv_heads, head_dim]``, float64."""
    k = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [num_heads, num_keys, head_dim]
    v = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
    probs = torch.softmax((k @ q.double()[:, :, None])[..., 0] / math.sqrt(q.shape[-1]), dim=-1)
    return (probs[:, None, :] @ v)[:, 0].float()


@pytest.mark.parametrize("kv_lens", [(1,), (5, 17, 33), (16, 4, 9, 48)])
def test_cpu_decode_step_matches_a_reference_over_a_poisoned_pool(kv_lens: tuple[int, ...]) -> None:
    """One decode step of several requests in scattered blocks of a NaN pool: the step's new K/V
    are written, the gathered keys stop at each request's end, GQA heads map to their KV head."""
    block_size, num_kv_heads, group, head_dim, num_layers = 4, 2, 3, 8, 2
    num_heads = num_kv_heads * group
    pool = torch.full((64, num_layers, 2, block_size, num_kv_heads, head_dim), math.nan)
    g = torch.Generator().manual_seed(len(kv_lens))
    free = torch.randperm(64, generator=g).tolist()
    chunks, tables, slots, keys, values = [], {}, [], [], []
    layer = 1
    for i, kv_len in enumerate(kv_lens):
        request_id = f"r{i}"
        blocks = tuple(free.pop() for _ in range(-(-kv_len // block_size)))
        tables[request_id] = (Segment(0, blocks, 0, kv_len),)
        chunks.append(ScheduledChunk(request_id, kv_len - 1, 1, True))
        k = torch.randn(kv_len, num_kv_heads, head_dim, generator=g)
        v = torch.randn(kv_len, num_kv_heads, head_dim, generator=g)
        for pos in range(kv_len - 1):  # the older keys are already in the pool
            pool[blocks[pos // block_size], layer, 0, pos % block_size] = k[pos]
            pool[blocks[pos // block_size], layer, 1, pos % block_size] = v[pos]
        last = kv_len - 1
        slots.append(blocks[last // block_size] * block_size + last % block_size)
        keys.append(k)
        values.append(v)
    step = build_step_attention(0, chunks, tables, slots, home_instance_id=0, block_size=block_size,
                                device=torch.device("cpu"))
    attention = DistAttention(step, pool, 0, None, num_heads=num_heads, sm_scale=head_dim**-0.5)
    assert attention._local_decode is not None  # the once-per-step gather is in use
    q = torch.randn(len(kv_lens), num_heads, head_dim, generator=g)
    new_k = torch.stack([k[-1] for k in keys])
    new_v = torch.stack([v[-1] for v in values])
    out = asyncio.run(attention(layer, q, new_k, new_v))
    assert out.shape == (len(kv_lens), num_heads, head_dim) and not torch.isnan(out).any()
    for i in range(len(kv_lens)):
        torch.testing.assert_close(out[i], _attention_reference(q[i], keys[i], values[i], group), atol=1e-5, rtol=1e-5)
