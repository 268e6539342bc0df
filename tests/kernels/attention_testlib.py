"""Builders and oracles shared by the kernel tests.

Every builder fills the parts of a KV pool that a kernel must never read (blocks no table
uses, slots past a sequence's last key, the other layer) with NaN, so that a stray read
shows up as a NaN in the output rather than as a small numeric error.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest
import torch

# backend="triton" on CPU tensors runs under Triton's interpreter, which tests/conftest.py
# switches on only where there is no GPU; on a GPU machine the `gpu` tests cover Triton.
NEEDS_INTERPRETER = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
    reason="backend='triton' on CPU tensors needs TRITON_INTERPRET=1",
)
BACKENDS = ["torch", pytest.param("triton", marks=NEEDS_INTERPRETER)]

# Block ids that unused block-table columns hold: every one outside any pool of these tests.
GARBAGE_BLOCK_IDS = (-1, 2**31 - 1, 10_000, -7)

# Relative-error bounds ||out - ref|| / ||ref|| for each input dtype.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
# Absolute bounds on the natural-log LSE.
LSE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` over every element, computed in float64."""
    diff = torch.linalg.vector_norm(out.double() - ref.double())
    return float(diff / torch.linalg.vector_norm(ref.double()).clamp_min(1e-30))


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)


def nan_pool(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> torch.Tensor:
    """A pool ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`` of NaN."""
    return torch.full((num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim), math.nan, dtype=dtype)


def scattered_block_ids(num_used: int, num_blocks: int, gen: torch.Generator) -> list[int]:
    """``num_used`` distinct block ids drawn at random from ``[0, num_blocks)``, in random order."""
    return torch.randperm(num_blocks, generator=gen)[:num_used].tolist()


def block_table(rows: list[list[int]], num_cols: int) -> torch.Tensor:
    """``[len(rows), num_cols]`` int32; columns past a row's blocks hold out-of-range garbage."""
    table = torch.empty(len(rows), num_cols, dtype=torch.int32)
    for i, row in enumerate(rows):
        padding = [GARBAGE_BLOCK_IDS[(i + j) % len(GARBAGE_BLOCK_IDS)] for j in range(num_cols - len(row))]
        table[i] = torch.tensor(row + padding, dtype=torch.int32)
    return table


def cumulative(lengths: list[int]) -> torch.Tensor:
    """``[len(lengths) + 1]`` int32: 0 then the running sums (a ``query_start_loc``)."""
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


@dataclass
class PagedBatch:
    """A batch of sequences whose K and V sit in scattered blocks of one NaN-poisoned pool.

    ``keys[i]`` and ``values[i]`` are ``[kv_lens[i], num_kv_heads, head_dim]``: what sequence i
    holds, in token order, as the pool holds them.
    """

    kv_pool: torch.Tensor  # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
    layer: int
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    kv_lens: torch.Tensor  # [num_seqs] int32
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


def paged_batch(
    kv_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    spare_blocks: int = 3,
    spare_columns: int = 2,
    num_layers: int = 2,
    layer: int = 1,
) -> PagedBatch:
    """Random K and V for each sequence, written into randomly chosen blocks of a pool."""
    blocks_per_seq = [-(-n // block_size) for n in kv_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    pool = nan_pool(num_blocks, num_layers, block_size, num_kv_heads, head_dim, dtype)
    ids = scattered_block_ids(sum(blocks_per_seq), num_blocks, gen)
    rows, keys, values = [], [], []
    for num_keys, num_seq_blocks in zip(kv_lens, blocks_per_seq):
        row, ids = ids[:num_seq_blocks], ids[num_seq_blocks:]
        k = randn(num_keys, num_kv_heads, head_dim, dtype=dtype, gen=gen)
        v = randn(num_keys, num_kv_heads, head_dim, dtype=dtype, gen=gen)
        for j, block_id in enumerate(row):
            lo, hi = j * block_size, min((j + 1) * block_size, num_keys)
            pool[block_id, layer, 0, : hi - lo] = k[lo:hi]
            pool[block_id, layer, 1, : hi - lo] = v[lo:hi]
        rows.append(row)
        keys.append(k)
        values.append(v)
    num_cols = max(blocks_per_seq, default=0) + spare_columns
    return PagedBatch(pool, layer, block_table(rows, num_cols), torch.tensor(kv_lens, dtype=torch.int32), keys, values)


def attention_float64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    q_pos: torch.Tensor | None,
    key_pos: torch.Tensor,
    sm_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent oracle: ``scaled_dot_product_attention`` in float64 with GQA.

    Args:
        q: ``[num_rows, num_heads, head_dim]``.
        k, v: ``[num_keys, num_kv_heads, head_dim]``.
        q_pos: ``[num_rows]`` absolute positions (a row sees keys at positions ``<=`` its own),
            or None: every row sees every key.
        key_pos: ``[num_keys]`` absolute positions of the keys.

    Returns:
        ``out [num_rows, num_heads, head_dim]`` and ``lse [num_rows, num_heads]`` (natural log),
        both float64; every row must see at least one key.
    """
    qh = q.double().transpose(0, 1)[None]  # [1, num_heads, num_rows, head_dim]
    kh = k.double().transpose(0, 1)[None]  # [1, num_kv_heads, num_keys, head_dim]
    vh = v.double().transpose(0, 1)[None]
    if q_pos is None:
        visible = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool)
    else:
        visible = key_pos[None, :].long() <= q_pos[:, None].long()
    assert bool(visible.any(dim=1).all()), "the oracle needs every row to see a key"
    out = torch.nn.functional.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=visible, scale=sm_scale, enable_gqa=True
    )
    group = q.shape[1] // k.shape[1]
    scores = qh @ kh.repeat_interleave(group, dim=1).transpose(-1, -2) * sm_scale
    lse = torch.logsumexp(scores.masked_fill(~visible, -math.inf), dim=-1)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1)
