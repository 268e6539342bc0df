"""Property: MicroAttention over any block-aligned sharding of a request's KV, merged with
merge_attention_states, is attention over the whole sequence.

Each shard sits in its own NaN-poisoned pool under its own random block ids, holds the keys
``[start, end)`` of the request (``kv_start_pos = start``), and may be empty. The oracle is
float64 ``scaled_dot_product_attention`` over the unsharded keys.
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
    attention_float64,
    block_table,
    cumulative,
    nan_pool,
    randn,
    relative_error,
    scattered_block_ids,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinite_llm.kernels import AttentionState, MicroAttentionConfig, merge_attention_states, micro_attention

LAYER = 1


@dataclass(frozen=True)
class ShardedRequest:
    dtype: torch.dtype
    num_kv_heads: int
    group: int
    head_dim: int
    block_size: int
    seq_len: int  # keys of the whole request
    shard_blocks: tuple[int, ...]  # block boundaries 0 = b_0 <= b_1 <= ... <= b_P = num_blocks
    q_pos: tuple[int, ...] | None  # absolute query positions; None: one decode row, no mask
    num_splits: int | None
    config: MicroAttentionConfig | None
    seed: int

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group

    def shard_tokens(self) -> list[tuple[int, int]]:
        """``[start, end)`` token range of each shard."""
        bounds = [min(b * self.block_size, self.seq_len) for b in self.shard_blocks]
        return list(zip(bounds[:-1], bounds[1:]))


@st.composite
def sharded_requests(draw: st.DrawFn, max_seq_len: int) -> ShardedRequest:
    block_size = draw(st.sampled_from([4, 8, 16]))
    seq_len = draw(st.integers(1, max_seq_len))
    num_blocks = -(-seq_len // block_size)
    num_shards = draw(st.integers(1, min(5, num_blocks + 1)))
    cuts = sorted(draw(st.lists(st.integers(0, num_blocks), min_size=num_shards - 1, max_size=num_shards - 1)))
    decode = draw(st.booleans())
    q_pos = None
    if not decode:
        q_pos = tuple(draw(st.lists(st.integers(0, seq_len - 1), min_size=1, max_size=6)))
    return ShardedRequest(
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        num_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([1, 3, 8])),
        head_dim=draw(st.sampled_from([16, 64, 80, 128])),
        block_size=block_size,
        seq_len=seq_len,
        shard_blocks=(0, *cuts, num_blocks),
        q_pos=q_pos,
        num_splits=draw(st.sampled_from([None, 1, 2, 3])),
        config=draw(st.sampled_from([None, MicroAttentionConfig(tile_n=16, rows_per_program=16)])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def shard_attention(
    request: ShardedRequest, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str, gen: torch.Generator
) -> list[AttentionState]:
    """MicroAttention of q over each shard, each shard in a pool of its own."""
    states = []
    for start, end in request.shard_tokens():
        num_keys = end - start
        num_shard_blocks = -(-num_keys // request.block_size)
        pool_blocks = num_shard_blocks + int(torch.randint(0, 3, (), generator=gen)) + 1
        pool = nan_pool(pool_blocks, 2, request.block_size, request.num_kv_heads, request.head_dim, request.dtype)
        ids = scattered_block_ids(num_shard_blocks, pool_blocks, gen)
        for j, block_id in enumerate(ids):
            lo = start + j * request.block_size
            hi = min(lo + request.block_size, end)
            pool[block_id, LAYER, 0, : hi - lo] = k[lo:hi]
            pool[block_id, LAYER, 1, : hi - lo] = v[lo:hi]
        causal = request.q_pos is not None
        states.append(
            micro_attention(
                q, pool, LAYER, block_table([ids], num_shard_blocks + 1),
                torch.tensor([num_keys], dtype=torch.int32), cumulative([q.shape[0]]),
                kv_start_pos=torch.tensor([start], dtype=torch.int32) if causal else None,
                q_pos=torch.tensor(request.q_pos, dtype=torch.int32) if causal else None,
                backend=backend, num_splits=request.num_splits, config=request.config,
            )
        )
    return states


def check_sharded_equals_whole(request: ShardedRequest, backend: str) -> None:
    gen = torch.Generator().manual_seed(request.seed)
    num_rows = 1 if request.q_pos is None else len(request.q_pos)
    q = randn(num_rows, request.num_heads, request.head_dim, dtype=request.dtype, gen=gen)
    k = randn(request.seq_len, request.num_kv_heads, request.head_dim, dtype=request.dtype, gen=gen)
    v = randn(request.seq_len, request.num_kv_heads, request.head_dim, dtype=request.dtype, gen=gen)

    states = shard_attention(request, q, k, v, backend, gen)
    merged = merge_attention_states([s.out for s in states], [s.lse for s in states], backend=backend)

    sm_scale = 1.0 / math.sqrt(request.head_dim)
    q_pos = torch.tensor(request.q_pos) if request.q_pos is not None else None
    want_out, want_lse = attention_float64(
        q, k, v, q_pos=q_pos, key_pos=torch.arange(request.seq_len), sm_scale=sm_scale
    )
    assert merged.out.shape == want_out.shape
    assert not torch.isnan(merged.out).any() and torch.isfinite(merged.lse).all()
    assert relative_error(merged.out, want_out) < RELATIVE_TOLERANCE[request.dtype]
    assert (merged.lse.double() - want_lse).abs().max() < LSE_TOLERANCE[request.dtype]
    # A shard with no key visible to a row reports exactly that: lse -inf, output zero.
    for (start, end), state in zip(request.shard_tokens(), states):
        sees = torch.full((num_rows,), end > start)
        if q_pos is not None:
            sees &= q_pos >= start
        assert torch.equal(torch.isneginf(state.lse), (~sees)[:, None].expand_as(state.lse))
        assert not state.out[~sees].any()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(request=sharded_requests(max_seq_len=256))
def test_sharded_torch_attention_equals_whole_sequence(request: ShardedRequest) -> None:
    check_sharded_equals_whole(request, "torch")


@NEEDS_INTERPRETER
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(request=sharded_requests(max_seq_len=128))
def test_sharded_triton_attention_equals_whole_sequence(request: ShardedRequest) -> None:
    check_sharded_equals_whole(request, "triton")


@pytest.mark.slow
@NEEDS_INTERPRETER
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None)
@given(request=sharded_requests(max_seq_len=400))
def test_sharded_triton_attention_equals_whole_sequence_many(request: ShardedRequest) -> None:
    check_sharded_equals_whole(request, "triton")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sharded_prefill_chunk_example(backend: str) -> None:
    """A fixed example: a 6-row prefill chunk at the end of 70 keys, cut into 3 shards + 1 empty."""
    request = ShardedRequest(
        dtype=torch.float32, num_kv_heads=2, group=3, head_dim=64, block_size=8, seq_len=70,
        shard_blocks=(0, 3, 3, 7, 9), q_pos=(64, 65, 66, 67, 68, 69), num_splits=2,
        config=MicroAttentionConfig(tile_n=16, rows_per_program=16), seed=1234,
    )
    assert request.shard_tokens() == [(0, 24), (24, 24), (24, 56), (56, 70)]
    check_sharded_equals_whole(request, backend)
