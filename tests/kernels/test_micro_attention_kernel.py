"""MicroAttention: the Triton kernel (under TRITON_INTERPRET=1 on the CPU) against the torch
reference, and the reference against a float64 ``scaled_dot_product_attention``.

Each case is a ragged batch in scattered blocks of a NaN-poisoned pool (see
``attention_testlib``): a kernel that reads a block, slot or layer it should not returns NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from attention_testlib import (
    BACKENDS,
    LSE_TOLERANCE,
    NEEDS_INTERPRETER,
    RELATIVE_TOLERANCE,
    PagedBatch,
    attention_float64,
    cumulative,
    paged_batch,
    randn,
    relative_error,
)

from infinite_llm.kernels import (
    AttentionState,
    MicroAttentionConfig,
    micro_attention,
    plan_micro_attention,
    run_micro_attention,
)

# Small tiles so that a few dozen keys span several KV tiles (and splits) and a few rows
# span several query tiles.
SMALL_TILES = MicroAttentionConfig(tile_n=16, rows_per_program=16)


@dataclass(frozen=True)
class Case:
    """One batch: per-sequence key and query-row counts and the attention shape."""

    kv_lens: tuple[int, ...]
    q_lens: tuple[int, ...]
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int
    causal: bool = False
    kv_start_pos: tuple[int, ...] | None = None  # default 0 (causal only)
    q_pos: tuple[int, ...] | None = None  # default: each sequence's last q_len positions (causal only)
    config: MicroAttentionConfig | None = SMALL_TILES

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def start_positions(self) -> list[int]:
        return list(self.kv_start_pos) if self.kv_start_pos is not None else [0] * len(self.kv_lens)

    def query_positions(self) -> list[int]:
        if self.q_pos is not None:
            return list(self.q_pos)
        positions = []
        for start, num_keys, num_rows in zip(self.start_positions(), self.kv_lens, self.q_lens):
            positions += [start + num_keys - num_rows + j for j in range(num_rows)]
        return positions


CASES = [
    pytest.param(Case((50, 16, 1, 0), (1, 1, 1, 1), 2, 1, 64, 16), id="decode-mha-ragged-empty-seq"),
    pytest.param(Case((33, 7, 64), (1, 1, 1), 2, 3, 64, 8), id="decode-gqa3-partial-blocks"),
    pytest.param(Case((40, 0, 17), (1, 1, 1), 1, 8, 128, 16), id="decode-gqa8-d128"),
    pytest.param(Case((45, 3), (1, 1), 2, 2, 80, 16), id="decode-d80-padded"),
    pytest.param(Case((20, 30, 0, 9), (1, 0, 1, 1), 2, 1, 64, 4), id="decode-seq-without-rows"),
    pytest.param(Case((70, 9), (1, 1), 2, 3, 64, 16, config=None), id="decode-default-config"),
    pytest.param(Case((37, 20, 0), (5, 3, 2), 2, 1, 64, 16, causal=True), id="causal-ragged-empty-seq"),
    pytest.param(
        Case(
            (40, 25), (6, 4), 1, 3, 64, 8, causal=True, kv_start_pos=(24, 0),
            # rows at 20 and 23 precede the shard's first key (24): they see nothing here.
            q_pos=(20, 23, 24, 30, 63, 100, 21, 22, 23, 24),
        ),
        id="causal-shard-kv-start-rows-see-nothing",
    ),
    pytest.param(Case((33, 50), (4, 7), 1, 8, 128, 16, causal=True), id="causal-gqa8-d128"),
    pytest.param(Case((30, 45), (3, 5), 2, 2, 64, 16), id="multirow-noncausal"),
    pytest.param(Case((29, 18), (5, 2), 2, 1, 80, 16, causal=True, kv_start_pos=(16, 3)), id="causal-d80-shard"),
    pytest.param(Case((130, 10, 0), (20, 3, 0), 1, 3, 64, 16, causal=True, config=None), id="causal-default-config"),
    pytest.param(Case((37,), (1,), 3, 3, 64, 16), id="decode-single-seq-partial-block"),
    # Every key's row is in the batch (a prompt's first chunk, or a shard's own rows): the CPU
    # reference takes the fused kernel's own causal mask there.
    pytest.param(Case((24, 40, 9), (24, 40, 9), 1, 3, 64, 16, causal=True, kv_start_pos=(0, 16, 5)),
                 id="causal-rows-are-the-keys"),
]

# Forced split counts on fp32; the automatic choice (None) on every dtype.
DTYPE_SPLITS = [
    pytest.param(torch.float32, None, id="fp32-auto"),
    pytest.param(torch.float32, 1, id="fp32-1split"),
    pytest.param(torch.float32, 2, id="fp32-2splits"),
    pytest.param(torch.float32, 3, id="fp32-3splits"),
    pytest.param(torch.float16, None, id="fp16-auto"),
    pytest.param(torch.float16, 2, id="fp16-2splits"),
    pytest.param(torch.bfloat16, None, id="bf16-auto"),
    pytest.param(torch.bfloat16, 3, id="bf16-3splits"),
]


@dataclass
class Inputs:
    batch: PagedBatch
    q: torch.Tensor  # [num_q_tokens, num_heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    kv_start_pos: torch.Tensor | None  # [num_seqs] int32
    q_pos: torch.Tensor | None  # [num_q_tokens] int32


def build(case: Case, dtype: torch.dtype, seed: int = 0) -> Inputs:
    gen = torch.Generator().manual_seed(seed)
    batch = paged_batch(
        list(case.kv_lens), block_size=case.block_size, num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim, dtype=dtype, gen=gen,
    )
    q = randn(sum(case.q_lens), case.num_heads, case.head_dim, dtype=dtype, gen=gen)
    kv_start_pos = q_pos = None
    if case.causal:
        kv_start_pos = torch.tensor(case.start_positions(), dtype=torch.int32)
        q_pos = torch.tensor(case.query_positions(), dtype=torch.int32)
    return Inputs(batch, q, cumulative(list(case.q_lens)), kv_start_pos, q_pos)


def attend(inputs: Inputs, case: Case, backend: str, num_splits: int | None = None, **kwargs) -> AttentionState:
    b = inputs.batch
    return micro_attention(
        inputs.q, b.kv_pool, b.layer, b.block_tables, b.kv_lens, inputs.query_start_loc,
        kv_start_pos=inputs.kv_start_pos, q_pos=inputs.q_pos, backend=backend,
        num_splits=num_splits, config=case.config, **kwargs,
    )


def assert_states_match(got: AttentionState, want: AttentionState, dtype: torch.dtype) -> None:
    """Same shapes, no NaN, the same rows empty (lse -inf, out 0), the rest within tolerance."""
    assert got.out.shape == want.out.shape and got.lse.shape == want.lse.shape
    assert got.lse.dtype == torch.float32
    assert not torch.isnan(got.out).any(), "NaN in out: a masked slot or unused block was read"
    assert not torch.isnan(got.lse).any()
    empty = torch.isneginf(want.lse)
    assert torch.equal(torch.isneginf(got.lse), empty)
    assert not torch.isinf(got.lse[~empty]).any()
    assert torch.equal(got.out[empty], torch.zeros_like(got.out[empty]))
    if (~empty).any():
        assert relative_error(got.out[~empty], want.out[~empty]) < RELATIVE_TOLERANCE[dtype]
        lse_error = (got.lse[~empty] - want.lse[~empty]).abs().max().item()
        assert lse_error < LSE_TOLERANCE[dtype]


@pytest.mark.parametrize("dtype, num_splits", DTYPE_SPLITS)
@pytest.mark.parametrize("case", CASES)
@NEEDS_INTERPRETER
def test_triton_matches_torch_reference(case: Case, dtype: torch.dtype, num_splits: int | None) -> None:
    inputs = build(case, dtype)
    want = attend(inputs, case, "torch")
    got = attend(inputs, case, "triton", num_splits)
    assert got.out.dtype == torch.float32
    assert_states_match(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_torch_reference_matches_float64_sdpa(case: Case, dtype: torch.dtype) -> None:
    """The oracle of the Triton tests, checked sequence by sequence against float64 SDPA."""
    inputs = build(case, dtype)
    state = attend(inputs, case, "torch")
    starts = inputs.query_start_loc.tolist()
    sm_scale = 1.0 / math.sqrt(case.head_dim)
    for seq, kv_start in enumerate(case.start_positions()):
        rows = slice(starts[seq], starts[seq + 1])
        keys = inputs.batch.keys[seq]
        key_pos = kv_start + torch.arange(keys.shape[0])
        q_pos = inputs.q_pos[rows] if case.causal else torch.full((rows.stop - rows.start,), 2**30)
        sees = (key_pos[None, :] <= q_pos[:, None].long()).any(dim=1)
        assert torch.isneginf(state.lse[rows][~sees]).all()
        assert torch.equal(state.out[rows][~sees], torch.zeros_like(state.out[rows][~sees]))
        if sees.any():
            want_out, want_lse = attention_float64(
                inputs.q[rows][sees], keys, inputs.batch.values[seq],
                q_pos=q_pos[sees] if case.causal else None, key_pos=key_pos, sm_scale=sm_scale,
            )
            assert relative_error(state.out[rows][sees], want_out) < 1e-5
            assert (state.lse[rows][sees].double() - want_lse).abs().max() < 1e-4


@NEEDS_INTERPRETER
def test_rows_before_the_shard_see_nothing_on_triton() -> None:
    """A row whose position precedes every key of this shard: lse -inf and a zero output."""
    case = CASES[7].values[0]
    inputs = build(case, torch.float32, seed=3)
    state = attend(inputs, case, "triton", num_splits=2)
    # q_pos 20, 23 (sequence 0, keys from 24) see nothing; 21..23 (sequence 1, keys from 0) do.
    assert torch.isneginf(state.lse[:2]).all()
    assert torch.equal(state.out[:2], torch.zeros(2, case.num_heads, case.head_dim))
    assert torch.isfinite(state.lse[2:]).all()
    assert (state.out[2:].abs().sum(dim=-1) > 0).all()


@NEEDS_INTERPRETER
def test_automatic_choice_splits_long_sequences() -> None:
    """Under the interpreter (8 SMs assumed) a long sequence gets more than one split."""
    case = Case((160, 40), (1, 1), 1, 3, 64, 16)
    inputs = build(case, torch.float32, seed=1)
    b = inputs.batch
    plan = plan_micro_attention(
        b.block_tables, b.kv_lens, inputs.query_start_loc, num_heads=3, num_kv_heads=1, head_dim=64,
        block_size=16, num_blocks=b.kv_pool.shape[0], backend="triton", config=SMALL_TILES,
    )
    assert plan.num_splits > 1
    assert plan.num_splits * plan.tiles_per_split * SMALL_TILES.tile_n >= 160
    got = run_micro_attention(plan, inputs.q, b.kv_pool, b.layer)
    assert_states_match(got, attend(inputs, case, "torch"), torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_plan_serves_every_layer(backend: str) -> None:
    case = Case((37, 20), (3, 2), 2, 3, 64, 8, causal=True, kv_start_pos=(0, 5))
    inputs = build(case, torch.float32, seed=2)
    b = inputs.batch
    gen = torch.Generator().manual_seed(5)
    # Fill layer 0 (NaN so far) with other keys.
    b.kv_pool[:, 0] = randn(*b.kv_pool[:, 0].shape, dtype=torch.float32, gen=gen)
    plan = plan_micro_attention(
        b.block_tables, b.kv_lens, inputs.query_start_loc, num_heads=6, num_kv_heads=2, head_dim=64,
        block_size=8, num_blocks=b.kv_pool.shape[0], kv_start_pos=inputs.kv_start_pos, q_pos=inputs.q_pos,
        backend=backend, num_splits=2, config=SMALL_TILES,
    )
    per_layer = [run_micro_attention(plan, inputs.q, b.kv_pool, layer) for layer in (0, 1)]
    for layer, got in enumerate(per_layer):
        want = micro_attention(
            inputs.q, b.kv_pool, layer, b.block_tables, b.kv_lens, inputs.query_start_loc,
            kv_start_pos=inputs.kv_start_pos, q_pos=inputs.q_pos, backend="torch",
        )
        assert_states_match(got, want, torch.float32)
    assert relative_error(per_layer[0].out, per_layer[1].out) > 0.1


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 2])
@NEEDS_INTERPRETER
def test_sm_scale_and_out_dtype(out_dtype: torch.dtype, num_splits: int) -> None:
    case = Case((45, 12), (4, 2), 2, 2, 64, 16, causal=True)
    inputs = build(case, torch.float16, seed=4)
    want = attend(inputs, case, "torch", sm_scale=0.3, out_dtype=out_dtype)
    got = attend(inputs, case, "triton", num_splits, sm_scale=0.3, out_dtype=out_dtype)
    assert got.out.dtype == want.out.dtype == out_dtype
    assert_states_match(got, want, torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float16)
    default_scale = attend(inputs, case, "torch", out_dtype=out_dtype)
    assert (default_scale.lse - want.lse).abs().max() > 0.1


@NEEDS_INTERPRETER
def test_q_with_row_stride_of_a_fused_qkv() -> None:
    """q sliced out of a fused [tokens, q|k|v heads, head_dim] tensor: rows are strided."""
    case = Case((40, 22), (4, 3), 2, 3, 64, 8, causal=True)
    inputs = build(case, torch.float32, seed=6)
    gen = torch.Generator().manual_seed(7)
    qkv = randn(7, case.num_heads + 2 * case.num_kv_heads, 64, dtype=torch.float32, gen=gen)
    qkv[:, : case.num_heads] = inputs.q
    inputs.q = qkv[:, : case.num_heads]
    assert not inputs.q.is_contiguous()
    want = attend(inputs, case, "torch")
    got = attend(inputs, case, "triton", num_splits=2)
    assert_states_match(got, want, torch.float32)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("case", [CASES[0], CASES[7]])
@NEEDS_INTERPRETER
def test_every_output_element_is_written(
    case: Case, num_splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every float buffer the wrapper allocates starts as NaN; none may survive to the result."""
    inputs = build(case, torch.float32, seed=8)
    want = attend(inputs, case, "torch")
    allocate = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = allocate(*args, **kwargs)
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    got = attend(inputs, case, "triton", num_splits)
    monkeypatch.undo()
    assert_states_match(got, want, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=["fp16", "bf16", "fp32"])
def test_triton_on_cuda_matches_reference(dtype: torch.dtype) -> None:
    """A moderate batch on the GPU: decode and causal multi-row, automatic splits."""
    for case in (
        Case((1000, 1, 0, 517, 64), (1, 1, 1, 1, 1), 8, 4, 128, 16, config=None),
        Case((700, 129, 300), (130, 1, 65), 4, 8, 128, 16, causal=True, kv_start_pos=(64, 0, 0), config=None),
        Case((333, 48), (17, 5), 2, 3, 80, 32, causal=True, config=None),
    ):
        inputs = build(case, dtype, seed=9)
        b = inputs.batch
        for name in ("q", "query_start_loc", "kv_start_pos", "q_pos"):
            t = getattr(inputs, name)
            setattr(inputs, name, t.cuda() if t is not None else None)
        b.kv_pool, b.block_tables, b.kv_lens = b.kv_pool.cuda(), b.block_tables.cuda(), b.kv_lens.cuda()
        want = attend(inputs, case, "torch")
        for num_splits in (None, 1, 4):
            got = attend(inputs, case, "triton", num_splits)
            assert got.out.is_cuda
            assert_states_match(
                AttentionState(got.out.cpu(), got.lse.cpu()), AttentionState(want.out.cpu(), want.lse.cpu()), dtype
            )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_splits", [1, 2])
def test_result_written_into_given_slots(backend: str, num_splits: int) -> None:
    """``into``: the result lands in slices of a larger buffer (a creditor's mailbox slots),
    the same as a fresh result, and nothing around the slices is touched."""
    case = Case((45, 19, 0), (1, 1, 1), 2, 2, 64, 8)
    inputs = build(case, torch.bfloat16, seed=4)
    b = inputs.batch
    plan = plan_micro_attention(
        b.block_tables, b.kv_lens, inputs.query_start_loc, num_heads=4, num_kv_heads=2, head_dim=64,
        block_size=8, num_blocks=b.kv_pool.shape[0], backend=backend, num_splits=num_splits, config=SMALL_TILES,
    )
    want = run_micro_attention(plan, inputs.q, b.kv_pool, b.layer, out_dtype=torch.bfloat16)
    out_slots = torch.full((2, 5, 4, 64), 7.0, dtype=torch.bfloat16)
    lse_slots = torch.full((2, 5, 4), 7.0)
    into = AttentionState(out_slots[1, 1:4], lse_slots[1, 1:4])
    got = run_micro_attention(plan, inputs.q, b.kv_pool, b.layer, out_dtype=torch.bfloat16, into=into)
    assert got.out.data_ptr() == into.out.data_ptr() and got.lse.data_ptr() == into.lse.data_ptr()
    assert torch.equal(got.out, want.out) and torch.equal(got.lse, want.lse)
    assert torch.isneginf(got.lse[2]).all() and not got.out[2].any()
    out_slots[1, 1:4] = 7.0
    lse_slots[1, 1:4] = 7.0
    assert (out_slots == 7.0).all() and (lse_slots == 7.0).all()


def test_result_slots_of_the_wrong_shape_or_dtype_are_refused() -> None:
    case = Case((20,), (1,), 1, 2, 64, 8)
    inputs = build(case, torch.float32, seed=4)
    b = inputs.batch
    plan = plan_micro_attention(
        b.block_tables, b.kv_lens, inputs.query_start_loc, num_heads=2, num_kv_heads=1, head_dim=64,
        block_size=8, num_blocks=b.kv_pool.shape[0], backend="torch",
    )
    with pytest.raises(ValueError, match="into holds out"):
        run_micro_attention(plan, inputs.q, b.kv_pool, b.layer,
                            into=AttentionState(torch.empty(2, 2, 64), torch.empty(2, 2)))
    with pytest.raises(ValueError, match="into holds out torch.bfloat16"):
        run_micro_attention(plan, inputs.q, b.kv_pool, b.layer,
                            into=AttentionState(torch.empty(1, 2, 64, dtype=torch.bfloat16), torch.empty(1, 2)))
