"""Sequence-parallel prefill: APB and ring against exact prefill, on hosts run as coroutines."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from infinite_llm.engine.config import ModelConfig
from infinite_llm.engine.model import LlamaModel
from infinite_llm.engine.seq_parallel import (
    APBConfig,
    LocalHostGroup,
    apb_prefill,
    attention_with_lse,
    exact_prefill,
    passing_block,
    ring_prefill,
)

CONFIG = ModelConfig(architecture="llama", vocab_size=97, hidden_size=64, intermediate_size=128, num_layers=3,
                     num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                     max_position=4096, tie_word_embeddings=False)


def tiny_model(seed: int = 0) -> LlamaModel:
    generator = torch.Generator().manual_seed(seed)
    c = CONFIG

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.2

    weights = {"embed_tokens": rand(c.vocab_size, c.hidden_size), "lm_head": rand(c.vocab_size, c.hidden_size),
               "norm": torch.ones(c.hidden_size)}
    for i in range(c.num_layers):
        weights |= {
            f"layers.{i}.input_norm": torch.ones(c.hidden_size),
            f"layers.{i}.post_attention_norm": torch.ones(c.hidden_size),
            f"layers.{i}.q_proj": rand(c.q_size, c.hidden_size), f"layers.{i}.k_proj": rand(c.kv_size, c.hidden_size),
            f"layers.{i}.v_proj": rand(c.kv_size, c.hidden_size), f"layers.{i}.o_proj": rand(c.hidden_size, c.q_size),
            f"layers.{i}.gate_proj": rand(c.intermediate_size, c.hidden_size),
            f"layers.{i}.up_proj": rand(c.intermediate_size, c.hidden_size),
            f"layers.{i}.down_proj": rand(c.hidden_size, c.intermediate_size),
        }
    return LlamaModel(c, weights, device="cpu", dtype=torch.float32)


def run_hosts(size: int, host_fn):
    async def main():
        groups = LocalHostGroup.create(size)
        return await asyncio.gather(*(host_fn(g) for g in groups))
    return asyncio.run(main())


def reference_attention(q, k, v, causal):
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(q.shape[-1])
    if causal:
        logits = logits.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).triu(1), float("-inf"))
    lse = logits.logsumexp(-1)
    out = torch.einsum("hnm,mhd->nhd", logits.softmax(-1), v)
    return out, lse.t()


@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_matches_softmax(causal):
    torch.manual_seed(0)
    q = torch.randn(12, 4, 16)
    k, v = torch.randn(12, 2, 16), torch.randn(12, 2, 16)
    state = attention_with_lse(q, k, v, causal=causal, sm_scale=16 ** -0.5)
    out, lse = reference_attention(q, k, v, causal)
    torch.testing.assert_close(state.out, out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state.lse, lse, atol=1e-5, rtol=1e-5)


def test_attention_with_no_keys_is_empty_and_causal_needs_square():
    q = torch.randn(3, 4, 16)
    empty = torch.empty(0, 2, 16)
    state = attention_with_lse(q, empty, empty, causal=False, sm_scale=0.25)
    assert torch.all(state.out == 0) and torch.all(state.lse == float("-inf"))
    with pytest.raises(ValueError, match="as many keys as rows"):
        attention_with_lse(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), causal=True, sm_scale=0.25)


def assert_hosts_match_exact(hosts, exact):
    for host in hosts:
        rows = host.positions
        torch.testing.assert_close(host.hidden, exact.hidden[rows], atol=2e-4, rtol=2e-4)
        for (k, v), (k_ref, v_ref) in zip(host.kv, exact.kv):
            torch.testing.assert_close(k, k_ref[rows], atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(v, v_ref[rows], atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("size", [2, 3])
def test_ring_prefill_is_exact(size):
    model = tiny_model()
    prompt = torch.randint(0, CONFIG.vocab_size, (24 * size,), generator=torch.Generator().manual_seed(1))
    exact = asyncio.run(exact_prefill(model, prompt))
    hosts = run_hosts(size, lambda g: ring_prefill(model, g, prompt))
    assert sorted(torch.cat([h.positions for h in hosts]).tolist()) == list(range(prompt.shape[0]))
    assert_hosts_match_exact(hosts, exact)


@pytest.mark.parametrize("size", [2, 3])
def test_apb_without_anchor_or_compression_is_exact(size):
    model = tiny_model()
    chunk = 20
    prompt = torch.randint(0, CONFIG.vocab_size, (chunk * size,), generator=torch.Generator().manual_seed(2))
    query = torch.randint(0, CONFIG.vocab_size, (5,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=0, passing_len=chunk)
    exact = asyncio.run(exact_prefill(model, prompt))
    hosts = run_hosts(size, lambda g: apb_prefill(model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk],
                                                  prompt[:0], query, config))
    assert_hosts_match_exact(hosts, exact)


def test_apb_with_compression_is_exact_on_the_first_host_only():
    model = tiny_model()
    chunk, size = 32, 3
    prompt = torch.randint(0, CONFIG.vocab_size, (chunk * size,), generator=torch.Generator().manual_seed(4))
    config = APBConfig(anchor_len=4, passing_len=6)
    exact = asyncio.run(exact_prefill(model, prompt))
    hosts = run_hosts(size, lambda g: apb_prefill(model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk],
                                                  prompt[:4], prompt[:0], config))
    assert_hosts_match_exact(hosts[:1], exact)  # host 0 sees all it would see anyway
    # Layer 0's K and V depend on the token alone: exact everywhere; deeper layers are not.
    for host in hosts[1:]:
        torch.testing.assert_close(host.kv[0][0], exact.kv[0][0][host.positions], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(host.hidden, exact.hidden[host.positions], atol=1e-3)
        assert torch.isfinite(host.hidden).all()


def test_passing_block_keeps_the_most_attended_keys_per_head():
    torch.manual_seed(5)
    n, kv_heads, head_dim = 40, 2, 8
    k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
    q = torch.randn(3, 4, head_dim)
    config = APBConfig(anchor_len=0, passing_len=5, pool_width=1)
    key_pos = torch.arange(n)
    score_pos = torch.full((3,), n)
    k_pass, v_pass = passing_block(k, v, q, score_pos, key_pos, config, head_dim ** -0.5)
    assert k_pass.shape == (5, kv_heads, head_dim)
    for head in range(kv_heads):
        rows = q[:, head * 2:(head + 1) * 2].reshape(-1, head_dim)  # the head's two query heads
        probs = (rows @ k[:, head].t() * head_dim ** -0.5).softmax(-1).sum(0)
        expected = probs.topk(5).indices.sort().values
        torch.testing.assert_close(k_pass[:, head], k[expected, head])
        torch.testing.assert_close(v_pass[:, head], v[expected, head])


def test_bad_apb_input_is_refused():
    with pytest.raises(ValueError, match="passing_len"):
        APBConfig(anchor_len=0, passing_len=0)
    with pytest.raises(ValueError, match="pool_width"):
        APBConfig(anchor_len=0, passing_len=4, pool_width=4)
    model = tiny_model()
    ids = torch.arange(8)
    with pytest.raises(ValueError, match="longer than a host's chunk"):
        run_hosts(1, lambda g: apb_prefill(model, g, ids, torch.arange(9), ids[:0], APBConfig(9, 4)))
    with pytest.raises(ValueError, match="non-empty chunk"):
        run_hosts(1, lambda g: apb_prefill(model, g, ids[:0], ids[:0], ids[:0], APBConfig(0, 4)))
    with pytest.raises(ValueError, match="multiple of 2 \\* hosts"):
        run_hosts(2, lambda g: ring_prefill(model, g, torch.arange(10)))
