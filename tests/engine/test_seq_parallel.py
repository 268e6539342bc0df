"""Sequence-parallel prefill: APB and ring against exact prefill, on hosts run as coroutines."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from infinite_llm.engine.seq_parallel import (
    APBConfig,
    LocalHostGroup,
    apb_prefill,
    extend_prefill,
    attention_with_lse,
    exact_prefill,
    passing_block,
    ring_prefill,
)

from tiny_llama import CONFIG, tiny_model  # tests/tiny_llama.py (tests/ is on sys.path)


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
        logits = logits.masked_fill(torch.ones(q.shape[0], k.shape[0], dtype=torch.bool, device=q.device).triu(1),
                                    float("-inf"))
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_on_cuda_matches_softmax(causal, dtype):
    """The flash kernel for 16-bit inputs, the memory-efficient one (padded lse rows) for fp32."""
    torch.manual_seed(0)
    q = torch.randn(45, 8, 64, device="cuda")
    k, v = torch.randn(45, 2, 64, device="cuda"), torch.randn(45, 2, 64, device="cuda")
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    state = attention_with_lse(q, k, v, causal=causal, sm_scale=64 ** -0.5)
    # Against float64 of the same (rounded) inputs; the kernel rounds P to bf16 before P @ V.
    out, lse = reference_attention(q.double(), k.double(), v.double(), causal)
    tol = 4e-2 if dtype == torch.bfloat16 else 2e-3
    assert state.out.dtype == dtype and state.lse.shape == (45, 8)
    torch.testing.assert_close(state.out.double(), out, atol=tol, rtol=tol)
    torch.testing.assert_close(state.lse.double(), lse, atol=tol, rtol=tol)


def test_post_attention_in_row_slices_is_the_whole_call():
    """A long APB chunk's output projection and MLP in slices of rows: the same rows out."""
    from infinite_llm.engine.seq_parallel import _post_attention_in_slices

    model = tiny_model()
    torch.manual_seed(1)
    hidden = torch.randn(37, CONFIG.hidden_size)
    attn_out = torch.randn(37, CONFIG.num_heads, CONFIG.head_dim)
    whole = model.post_attention(0, hidden.clone(), attn_out)
    sliced = _post_attention_in_slices(model, 0, hidden.clone(), attn_out, rows=8)
    torch.testing.assert_close(sliced, whole, atol=1e-5, rtol=1e-5)


def test_attention_with_no_keys_is_empty_and_causal_needs_square():
    q = torch.randn(3, 4, 16)
    empty = torch.empty(0, 2, 16)
    state = attention_with_lse(q, empty, empty, causal=False, sm_scale=0.25)
    assert torch.all(state.out == 0) and torch.all(state.lse == float("-inf"))
    with pytest.raises(ValueError, match="as many keys as rows"):
        attention_with_lse(q, torch.randn(4, 2, 16), torch.randn(4, 2, 16), causal=True, sm_scale=0.25)


def test_attention_with_lse_refuses_heads_it_cannot_pair_and_mismatched_k_v():
    q = torch.randn(4, 3, 16)
    k, v = torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    with pytest.raises(ValueError, match=r"query heads \(3\) must be a multiple of KV heads \(2\)"):
        attention_with_lse(q, k, v, causal=False, sm_scale=0.25)
    q = torch.randn(4, 4, 16)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        attention_with_lse(q, k, torch.randn(5, 2, 16), causal=False, sm_scale=0.25)
    with pytest.raises(ValueError, match="k and v must have one shape"):
        attention_with_lse(q, k, torch.randn(4, 2, 8), causal=False, sm_scale=0.25)
    with pytest.raises(ValueError, match="q has head_dim 16, k and v have 8"):
        attention_with_lse(q, torch.randn(4, 2, 8), torch.randn(4, 2, 8), causal=False, sm_scale=0.25)


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


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize("anchor_len", [4, 20])  # 20: all of host 0's chunk, so it passes nothing
@pytest.mark.parametrize("query_len", [0, 5])
def test_apb_with_anchor_and_no_compression_is_exact(size, anchor_len, query_len):
    # Every earlier key is seen once: the anchor from the anchor block, the rest of host 0's
    # chunk and the other chunks whole from the passing blocks.
    model = tiny_model()
    chunk = 20
    prompt = torch.randint(0, CONFIG.vocab_size, (chunk * size,), generator=torch.Generator().manual_seed(2))
    query = torch.randint(0, CONFIG.vocab_size, (query_len,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=anchor_len, passing_len=chunk)
    exact = asyncio.run(exact_prefill(model, prompt))
    hosts = run_hosts(size, lambda g: apb_prefill(model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk],
                                                  prompt[:anchor_len], query, config))
    assert_hosts_match_exact(hosts, exact)


class RecordingHostGroup(LocalHostGroup):
    """A :class:`LocalHostGroup` that keeps every tensor this host puts into an all-gather."""

    def __init__(self, rank: int, size: int, shared: dict) -> None:
        super().__init__(rank, size, shared)
        self.sent: list[torch.Tensor] = []

    async def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        self.sent.append(tensor)
        return await super().all_gather(tensor)


def run_recording_hosts(size: int, host_fn, *, return_exceptions: bool = False):
    async def main():
        groups = RecordingHostGroup.create(size)
        return groups, await asyncio.gather(*(host_fn(g) for g in groups), return_exceptions=return_exceptions)
    return asyncio.run(main())


def test_apb_pads_host_0s_shorter_passing_block_and_ignores_the_padding():
    # Host 0 has 16 - 12 = 4 keys past the anchor to pass, host 1 passes 8; host 0's block is
    # zero-padded to 8 for the all-gather. Host 1 reads host 0's whole block, so it is exact only
    # if the 4 padding keys get no weight.
    model = tiny_model()
    chunk, size, anchor_len, passing_len = 16, 2, 12, 8
    prompt = torch.randint(0, CONFIG.vocab_size, (chunk * size,), generator=torch.Generator().manual_seed(6))
    config = APBConfig(anchor_len=anchor_len, passing_len=passing_len)
    exact = asyncio.run(exact_prefill(model, prompt))
    groups, hosts = run_recording_hosts(size, lambda g: apb_prefill(
        model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk], prompt[:anchor_len], prompt[:0], config))
    assert_hosts_match_exact(hosts, exact)
    passed = groups[0].sent[1]  # [2, passing_len, kv_heads, head_dim], layer 0 (after the chunk lengths)
    assert passed.shape == (2, passing_len, CONFIG.num_kv_heads, CONFIG.head_dim)
    k0, v0 = exact.kv[0]
    torch.testing.assert_close(passed[0, :4], k0[anchor_len:chunk], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(passed[1, :4], v0[anchor_len:chunk], atol=1e-5, rtol=1e-5)
    assert torch.all(passed[:, 4:] == 0)


@pytest.mark.parametrize("bounds", [[(0, 20), (20, 40), (40, 55)], [(0, 15), (15, 35), (35, 55)]])
def test_apb_with_unequal_chunks_is_exact_at_their_true_positions(bounds):
    model = tiny_model()
    prompt = torch.randint(0, CONFIG.vocab_size, (55,), generator=torch.Generator().manual_seed(2))
    query = torch.randint(0, CONFIG.vocab_size, (5,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=4, passing_len=20)  # nothing dropped
    exact = asyncio.run(exact_prefill(model, prompt))
    hosts = run_hosts(len(bounds), lambda g: apb_prefill(model, g, prompt[slice(*bounds[g.rank])], prompt[:4],
                                                         query, config))
    for (start, end), host in zip(bounds, hosts):
        assert host.positions.tolist() == list(range(start, end))
    assert_hosts_match_exact(hosts, exact)


def test_apb_refuses_chunk_lengths_on_every_host_alike():
    model = tiny_model()
    ids = torch.arange(10)
    # Host 0's chunk (4 tokens) cannot hold a 6-token anchor, though host 1's (10) could.
    _, errors = run_recording_hosts(2, lambda g: apb_prefill(model, g, ids[:4] if g.rank == 0 else ids, ids[:6],
                                                              ids[:0], APBConfig(6, 4)), return_exceptions=True)
    for error in errors:
        assert isinstance(error, ValueError) and "longer than host 0's chunk (4)" in str(error)
    _, errors = run_recording_hosts(2, lambda g: apb_prefill(model, g, ids[:0] if g.rank == 1 else ids, ids[:0],
                                                              ids[:0], APBConfig(0, 4)), return_exceptions=True)
    for error in errors:
        assert isinstance(error, ValueError) and "non-empty chunk" in str(error) and "[10, 0]" in str(error)


def test_apb_query_rows_score_at_their_true_positions():
    # Host 1's layer-0 passing block depends only on its own tokens: recompute it with the
    # query rows rotated after the document (positions 128..133) and compare.
    model = tiny_model()
    chunk, size, anchor_len, passing_len, query_len = 64, 2, 4, 8, 6
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, CONFIG.vocab_size, (chunk * size,), generator=generator)
    query = torch.randint(0, CONFIG.vocab_size, (query_len,), generator=generator)
    config = APBConfig(anchor_len=anchor_len, passing_len=passing_len)
    groups, _ = run_recording_hosts(size, lambda g: apb_prefill(
        model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk], prompt[:anchor_len], query, config))
    passed = groups[1].sent[1]  # layer 0

    chunk_pos = torch.arange(chunk, 2 * chunk)
    block_len = anchor_len + query_len

    def reference_block(query_pos):
        ids = torch.cat([prompt[:anchor_len], query, prompt[chunk:]])
        q, k, v = model.pre_attention(0, model.embed(ids), torch.cat([torch.arange(anchor_len), query_pos, chunk_pos]))
        return passing_block(k[block_len:], v[block_len:], q[anchor_len:block_len], query_pos, chunk_pos, config,
                             model.sm_scale)

    true_k, true_v = reference_block(torch.arange(chunk * size, chunk * size + query_len))
    torch.testing.assert_close(passed[0], true_k)
    torch.testing.assert_close(passed[1], true_v)
    # The positions matter here: rotated right after the anchor, the query picks other keys.
    wrong_k, _ = reference_block(torch.arange(anchor_len, block_len))
    assert not torch.equal(wrong_k, true_k)


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


@pytest.mark.parametrize("first_candidate", [0, 6])
def test_passing_block_keeps_the_most_attended_keys_per_head(first_candidate):
    torch.manual_seed(5)
    n, kv_heads, head_dim = 40, 2, 8
    k, v = torch.randn(n, kv_heads, head_dim), torch.randn(n, kv_heads, head_dim)
    q = torch.randn(3, 4, head_dim)
    config = APBConfig(anchor_len=0, passing_len=5, pool_width=1)
    key_pos = torch.arange(n)
    score_pos = torch.full((3,), n)
    k_pass, v_pass = passing_block(k, v, q, score_pos, key_pos, config, head_dim ** -0.5,
                                   first_candidate=first_candidate)
    assert k_pass.shape == (5, kv_heads, head_dim)
    for head in range(kv_heads):
        rows = q[:, head * 2:(head + 1) * 2].reshape(-1, head_dim)  # the head's two query heads
        # The softmax runs over every key; only keys from first_candidate on can be chosen.
        probs = (rows @ k[:, head].t() * head_dim ** -0.5).softmax(-1).sum(0)
        expected = probs[first_candidate:].topk(5).indices.sort().values + first_candidate
        torch.testing.assert_close(k_pass[:, head], k[expected, head])
        torch.testing.assert_close(v_pass[:, head], v[expected, head])


def test_bad_apb_input_is_refused():
    with pytest.raises(ValueError, match="passing_len"):
        APBConfig(anchor_len=0, passing_len=-1)
    with pytest.raises(ValueError, match="scorer"):
        APBConfig(anchor_len=0, passing_len=4, scorer="best")
    with pytest.raises(ValueError, match="pool_width"):
        APBConfig(anchor_len=0, passing_len=4, pool_width=4)
    model = tiny_model()
    ids = torch.arange(8)
    with pytest.raises(ValueError, match="longer than host 0's chunk"):
        run_hosts(1, lambda g: apb_prefill(model, g, ids, torch.arange(9), ids[:0], APBConfig(9, 4)))
    with pytest.raises(ValueError, match="non-empty chunk"):
        run_hosts(1, lambda g: apb_prefill(model, g, ids[:0], ids[:0], ids[:0], APBConfig(0, 4)))
    with pytest.raises(ValueError, match="multiple of 2 \\* hosts"):
        run_hosts(2, lambda g: ring_prefill(model, g, torch.arange(10)))


def test_apb_without_passing_blocks_sees_the_anchor_and_its_own_chunk_only():
    # Star-Attention-like: no all-gather per layer; host 1's rows equal an exact prefill of
    # anchor + chunk 1 at their true positions, which the anchor-less host 0 row shows.
    model = tiny_model()
    size, chunk, anchor_len = 2, 12, 4
    prompt = torch.randint(0, model.config.vocab_size, (size * chunk,), generator=torch.Generator().manual_seed(3))
    config = APBConfig(anchor_len=anchor_len, passing_len=0)
    groups, hosts = run_recording_hosts(size, lambda g: apb_prefill(model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk],
                                                                  prompt[:anchor_len], prompt[:0], config))
    assert all(len(g.sent) == 1 for g in groups)  # only the chunk lengths, before layer 0
    exact = asyncio.run(exact_prefill(model, prompt[:chunk]))
    torch.testing.assert_close(hosts[0].hidden, exact.hidden, rtol=1e-4, atol=1e-4)
    assert hosts[1].positions.tolist() == list(range(chunk, 2 * chunk))


def test_apb_random_scorer_passes_as_many_keys_and_is_seeded():
    model = tiny_model()
    size, chunk = 3, 16
    prompt = torch.randint(0, model.config.vocab_size, (size * chunk,), generator=torch.Generator().manual_seed(4))

    def run(seed):
        config = APBConfig(anchor_len=4, passing_len=5, scorer="random", seed=seed)
        return run_recording_hosts(size, lambda g: apb_prefill(model, g, prompt[g.rank * chunk:(g.rank + 1) * chunk],
                                                               prompt[:4], prompt[:0], config))
    groups_a, hosts_a = run(1)
    _, hosts_b = run(1)
    _, hosts_c = run(2)
    # every per-layer gather carries [2, 5, kv_heads, head_dim]
    assert all(t.shape[1] == 5 for t in groups_a[0].sent[1:])
    torch.testing.assert_close(hosts_a[2].hidden, hosts_b[2].hidden)
    assert not torch.allclose(hosts_a[2].hidden, hosts_c[2].hidden)


def test_apb_kv_sink_gets_every_layers_chunk_kv_and_extend_prefill_continues_exactly():
    model = tiny_model()
    size, chunk = 2, 10
    prompt = torch.randint(0, model.config.vocab_size, (size * chunk + 3,), generator=torch.Generator().manual_seed(5))
    doc, tail = prompt[:size * chunk], prompt[size * chunk:]
    sunk: dict[int, dict[int, tuple]] = {0: {}, 1: {}}
    config = APBConfig(anchor_len=0, passing_len=chunk)  # nothing dropped: exact

    def host(g):
        return apb_prefill(model, g, doc[g.rank * chunk:(g.rank + 1) * chunk], doc[:0], doc[:0], config,
                           kv_sink=lambda layer, k, v: sunk[g.rank].__setitem__(layer, (k.clone(), v.clone())))
    hosts = run_hosts(size, host)
    assert all(h.kv == [] for h in hosts)
    past = [(torch.cat([sunk[0][layer][0], sunk[1][layer][0]]), torch.cat([sunk[0][layer][1], sunk[1][layer][1]]))
            for layer in range(model.config.num_layers)]
    after = asyncio.run(extend_prefill(model, past, tail))
    exact = asyncio.run(exact_prefill(model, prompt))
    assert after.positions.tolist() == list(range(size * chunk, size * chunk + 3))
    torch.testing.assert_close(after.hidden, exact.hidden[size * chunk:], rtol=1e-4, atol=1e-4)
