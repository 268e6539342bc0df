"""merge_attention_states and write_kv: the Triton kernels (under TRITON_INTERPRET=1 on the
CPU) against the torch references and against float64 formulas."""

from __future__ import annotations

import math

import pytest
import torch
from attention_testlib import BACKENDS, NEEDS_INTERPRETER, RELATIVE_TOLERANCE, randn, relative_error

from infinite_llm.kernels import AttentionState, merge_attention_states, merge_two_attention_states, write_kv

ALL_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]


def partial_states(
    num_parts: int, num_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """P random partial states with some empty parts and one all-empty row.

    Returns ``out_parts [P, T, H, D]`` (NaN wherever a part is empty), ``lse_parts [P, T, H]``
    float32 (``-inf`` for an empty part) and ``empty [P, T, H]`` bool.
    """
    gen = torch.Generator().manual_seed(seed)
    out_parts = randn(num_parts, num_tokens, num_heads, head_dim, dtype=dtype, gen=gen)
    lse_parts = 4.0 * torch.randn(num_parts, num_tokens, num_heads, generator=gen)
    empty = torch.rand(num_parts, num_tokens, num_heads, generator=gen) < 0.3
    empty[:, 0, 0] = True  # token 0, head 0: every part empty
    if num_parts > 1:
        empty[1:, 1, :] = True  # token 1: only part 0 holds keys
    lse_parts[empty] = -math.inf
    out_parts[empty] = math.nan  # an empty part's output is garbage the merge must ignore
    return out_parts, lse_parts, empty


def merge_float64(out_parts: torch.Tensor, lse_parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_p softmax(lse)_p * out_p`` and ``logsumexp(lse)`` in float64, empty parts dropped."""
    lse = lse_parts.double()
    weights = torch.softmax(lse, dim=0).nan_to_num(0.0)  # all-empty rows: 0/0 -> 0
    out = torch.where(weights[..., None] > 0, out_parts.double(), 0.0)
    return (weights[..., None] * out).sum(dim=0), torch.logsumexp(lse, dim=0)


def assert_merged(got: AttentionState, out_parts: torch.Tensor, lse_parts: torch.Tensor, dtype: torch.dtype) -> None:
    want_out, want_lse = merge_float64(out_parts, lse_parts)
    all_empty = torch.isneginf(lse_parts).all(dim=0)
    assert bool(all_empty.any())
    assert got.lse.dtype == torch.float32
    assert not torch.isnan(got.out).any() and not torch.isnan(got.lse).any()
    assert torch.equal(torch.isneginf(got.lse), all_empty)
    assert torch.equal(got.out[all_empty], torch.zeros_like(got.out[all_empty]))
    assert relative_error(got.out[~all_empty], want_out[~all_empty]) < RELATIVE_TOLERANCE[dtype]
    assert (got.lse[~all_empty].double() - want_lse[~all_empty]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_parts", [1, 2, 7, 16, 64])
@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_matches_float64_formula(backend: str, num_parts: int, dtype: torch.dtype) -> None:
    out_parts, lse_parts, _ = partial_states(num_parts, 5, 3, 64, dtype, seed=num_parts)
    got = merge_attention_states(out_parts, lse_parts, backend=backend)
    assert got.out.dtype == dtype and got.out.shape == (5, 3, 64)
    assert_merged(got, out_parts, lse_parts, dtype)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("num_parts", [1, 2, 7, 16, 64])
@NEEDS_INTERPRETER
def test_merge_triton_matches_torch(num_parts: int, dtype: torch.dtype) -> None:
    out_parts, lse_parts, _ = partial_states(num_parts, 4, 2, 80, dtype, seed=100 + num_parts)
    got = merge_attention_states(out_parts, lse_parts, backend="triton")
    want = merge_attention_states(out_parts, lse_parts, backend="torch")
    assert torch.equal(torch.isneginf(got.lse), torch.isneginf(want.lse))
    finite = torch.isfinite(want.lse)
    assert (got.lse[finite] - want.lse[finite]).abs().max() < 1e-5
    assert relative_error(got.out, want.out) < RELATIVE_TOLERANCE[dtype]
    assert torch.equal(got.out[~finite], want.out[~finite])


@pytest.mark.parametrize("backend", BACKENDS)
def test_single_part_merges_to_itself(backend: str) -> None:
    out_parts, lse_parts, empty = partial_states(1, 6, 2, 64, torch.float32, seed=7)
    got = merge_attention_states(out_parts, lse_parts, backend=backend)
    assert torch.allclose(got.out[~empty[0]], out_parts[0][~empty[0]], rtol=1e-6, atol=1e-6)
    assert torch.equal(got.lse, lse_parts[0])


@pytest.mark.parametrize("num_parts", [2, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_base2_lse_gives_the_same_merge(backend: str, num_parts: int) -> None:
    out_parts, lse_parts, _ = partial_states(num_parts, 5, 3, 64, torch.float32, seed=11)
    natural = merge_attention_states(out_parts, lse_parts, backend=backend)
    base2 = merge_attention_states(out_parts, lse_parts / math.log(2.0), lse_base="2", backend=backend)
    assert torch.allclose(base2.out, natural.out, rtol=1e-5, atol=1e-6)
    # The merged lse is a natural log whatever the input base.
    assert torch.allclose(base2.lse, natural.lse, rtol=1e-5, atol=1e-5, equal_nan=False)
    assert torch.equal(torch.isneginf(base2.lse), torch.isneginf(natural.lse))
    assert_merged(base2, out_parts, lse_parts, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_list_of_parts_equals_stacked_parts(backend: str) -> None:
    out_parts, lse_parts, _ = partial_states(7, 4, 2, 64, torch.float16, seed=13)
    stacked = merge_attention_states(out_parts, lse_parts, backend=backend)
    listed = merge_attention_states(list(out_parts.unbind(0)), tuple(lse_parts.unbind(0)), backend=backend)
    assert torch.equal(listed.out, stacked.out)
    assert torch.equal(listed.lse, stacked.lse)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merge_out_dtype_and_strided_parts(backend: str) -> None:
    out_parts, lse_parts, _ = partial_states(3, 5, 4, 64, torch.float32, seed=17)
    # Parts seen through a transposed view: the head and token strides are swapped.
    strided = out_parts.transpose(1, 2).contiguous().transpose(1, 2)
    got = merge_attention_states(strided, lse_parts.transpose(1, 2).contiguous().transpose(1, 2),
                                 out_dtype=torch.bfloat16, backend=backend)
    assert got.out.dtype == torch.bfloat16
    assert_merged(got, out_parts, lse_parts, torch.bfloat16)


@NEEDS_INTERPRETER
def test_merge_of_key_halves_equals_attention_over_all_keys() -> None:
    """Attention over keys A and over keys B, merged, is attention over A + B."""
    gen = torch.Generator().manual_seed(19)
    q, k, v = (torch.randn(3, n, 32, generator=gen) for n in (4, 20, 20))  # [heads, rows|keys, dim]

    def attention(keys: slice) -> tuple[torch.Tensor, torch.Tensor]:
        scores = q @ k[:, keys].transpose(1, 2) / math.sqrt(32)
        out = torch.softmax(scores, -1) @ v[:, keys]
        return out.transpose(0, 1), torch.logsumexp(scores, -1).transpose(0, 1)  # [rows, heads, ...]

    whole_out, whole_lse = attention(slice(0, 20))
    parts = [attention(slice(0, 7)), attention(slice(7, 20))]
    for backend in ("torch", "triton"):
        got = merge_attention_states([p[0] for p in parts], [p[1] for p in parts], backend=backend)
        assert relative_error(got.out, whole_out) < 1e-5
        assert (got.lse - whole_lse).abs().max() < 1e-5


# --- write_kv -------------------------------------------------------------------------


def random_pool(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen), gen


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize(
    "dtype, num_kv_heads, head_dim",
    [(torch.float32, 2, 64), (torch.float16, 1, 128), (torch.bfloat16, 3, 80), (torch.float16, 8, 64)],
    ids=["fp32-2x64", "fp16-1x128", "bf16-3x80", "fp16-8x64"],
)
@NEEDS_INTERPRETER
def test_write_kv_triton_matches_torch_and_touches_only_its_slots(
    dtype: torch.dtype, num_kv_heads: int, head_dim: int, slot_dtype: torch.dtype
) -> None:
    block_size, num_blocks, layer = 8, 6, 1
    pool, gen = random_pool(num_blocks, block_size, num_kv_heads, head_dim, dtype, seed=23)
    num_tokens = 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(slot_dtype)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    by_torch, by_triton = pool.clone(), pool.clone()
    write_kv(k, v, by_torch, layer, slots, backend="torch")
    write_kv(k, v, by_triton, layer, slots, backend="triton")
    assert torch.equal(by_triton, by_torch)

    block_ids, offsets = (slots // block_size).long(), (slots % block_size).long()
    assert torch.equal(by_triton[block_ids, layer, 0, offsets], k)
    assert torch.equal(by_triton[block_ids, layer, 1, offsets], v)
    written = torch.zeros(num_blocks, 2, 2, block_size, dtype=torch.bool)
    written[block_ids, layer, :, offsets] = True
    assert torch.equal(by_triton[~written], pool[~written])


@NEEDS_INTERPRETER
def test_write_kv_into_the_last_slot_and_strided_rows() -> None:
    """Slot num_blocks * block_size - 1 is in range; k and v may be views of a fused tensor."""
    pool, gen = random_pool(3, 4, 2, 64, torch.float32, seed=29)
    kv = randn(3, 4, 64, dtype=torch.float32, gen=gen)  # [tokens, k heads | v heads, dim]
    k, v = kv[:, :2], kv[:, 2:]
    slots = torch.tensor([11, 0, 6], dtype=torch.int32)
    for backend in ("torch", "triton"):
        target = pool.clone()
        write_kv(k, v, target, 0, slots, backend=backend)
        assert torch.equal(target[2, 0, 0, 3], k[0]) and torch.equal(target[2, 0, 1, 3], v[0])
        assert torch.equal(target[0, 0, 0, 0], k[1]) and torch.equal(target[1, 0, 1, 2], v[2])
        assert torch.equal(target[:, 1], pool[:, 1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_kv_of_no_tokens_changes_nothing(backend: str) -> None:
    pool, _ = random_pool(3, 4, 2, 64, torch.float16, seed=31)
    before = pool.clone()
    empty = torch.empty(0, 2, 64, dtype=torch.float16)
    write_kv(empty, empty, pool, 1, torch.empty(0, dtype=torch.int64), backend=backend)
    assert torch.equal(pool, before)


@pytest.mark.gpu
def test_merge_and_write_kv_on_cuda_match_reference() -> None:
    out_parts, lse_parts, _ = partial_states(24, 257, 32, 128, torch.bfloat16, seed=37)
    got = merge_attention_states(out_parts.cuda(), lse_parts.cuda(), backend="triton")
    assert_merged(AttentionState(got.out.cpu(), got.lse.cpu()), out_parts, lse_parts, torch.bfloat16)

    pool, gen = random_pool(64, 16, 8, 128, torch.float16, seed=41)
    slots = torch.randperm(64 * 16, generator=gen)[:300]
    k = randn(300, 8, 128, dtype=torch.float16, gen=gen)
    v = randn(300, 8, 128, dtype=torch.float16, gen=gen)
    want = pool.clone()
    write_kv(k, v, want, 1, slots, backend="torch")
    on_gpu = pool.cuda()
    write_kv(k.cuda(), v.cuda(), on_gpu, 1, slots.cuda(), backend="triton")
    assert torch.equal(on_gpu.cpu(), want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype_b", ALL_DTYPES)
def test_merge_two_states_equals_the_general_merge(backend: str, dtype_b: torch.dtype) -> None:
    """The home's part (float32) and a creditor's (any dtype), merged where they lie: the same
    output as ``merge_attention_states`` over the two parts stacked, empty parts included."""
    out_parts, lse_parts, _ = partial_states(2, 5, 4, 24, torch.float32, seed=7)
    home = AttentionState(out_parts[0], lse_parts[0])
    creditor = AttentionState(out_parts[1].to(dtype_b), lse_parts[1])
    for out_dtype in (torch.float32, torch.bfloat16):
        got = merge_two_attention_states(home, creditor, out_dtype=out_dtype, backend=backend)
        stacked = torch.stack([home.out, creditor.out.float()])
        want = merge_attention_states(stacked, lse_parts, out_dtype=out_dtype, backend=backend).out
        assert got.dtype == out_dtype and got.shape == home.out.shape
        assert not torch.isnan(got).any()
        assert torch.equal(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merges_of_two_chain_into_the_merge_of_all(backend: str) -> None:
    """A row held by the home and two creditors: two merges of two (the first keeping its
    log-sum-exp) give the merge of the three parts, empty parts and rows included."""
    out_parts, lse_parts, _ = partial_states(3, 6, 4, 24, torch.float32, seed=11)
    parts = [AttentionState(out_parts[p], lse_parts[p]) for p in range(3)]
    first = merge_two_attention_states(parts[0], parts[1], out_dtype=torch.float32, backend=backend, with_lse=True)
    want_two = merge_attention_states(out_parts[:2], lse_parts[:2], out_dtype=torch.float32, backend=backend)
    assert torch.equal(first.out, want_two.out)
    assert torch.allclose(first.lse, want_two.lse, rtol=0, atol=1e-6)
    assert torch.equal(torch.isneginf(first.lse), torch.isneginf(want_two.lse))
    got = merge_two_attention_states(first, parts[2], out_dtype=torch.float32, backend=backend)
    want_out, _ = merge_float64(out_parts, lse_parts)
    assert not torch.isnan(got).any()
    assert torch.allclose(got.double(), want_out, rtol=1e-5, atol=1e-6)


def test_merge_two_states_refuses_parts_that_disagree() -> None:
    a = AttentionState(torch.zeros(3, 2, 8), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="one shape"):
        merge_two_attention_states(a, AttentionState(torch.zeros(4, 2, 8), torch.zeros(4, 2)), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="lse must be float32"):
        merge_two_attention_states(a, AttentionState(torch.zeros(3, 2, 8), torch.zeros(3, 2, dtype=torch.float64)),
                                   out_dtype=torch.float32)
