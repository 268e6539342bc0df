"""Bad input to the kernel wrappers: a ValueError that names the problem, and no write to the pool."""

from __future__ import annotations

import math
from typing import Callable

import pytest
import torch
from attention_testlib import BACKENDS, NEEDS_INTERPRETER, randn

from infinite_llm.kernels import merge_attention_states, micro_attention, plan_micro_attention, write_kv

NUM_BLOCKS, NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 8, 2, 16, 2, 64


def valid_attention_args() -> dict:
    """A valid causal call: 2 sequences of 20 and 40 keys, 2 and 3 query rows, 4 query heads."""
    gen = torch.Generator().manual_seed(0)
    return {
        "q": randn(5, 4, HEAD_DIM, dtype=torch.float32, gen=gen),
        "kv_pool": randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float32, gen=gen),
        "layer": 1,
        # Column 2 of row 0 is unused: its out-of-range id must be ignored.
        "block_tables": torch.tensor([[3, 5, 99], [0, 7, 2]], dtype=torch.int32),
        "kv_lens": torch.tensor([20, 40], dtype=torch.int32),
        "query_start_loc": torch.tensor([0, 2, 5], dtype=torch.int32),
        "kv_start_pos": torch.tensor([0, 0], dtype=torch.int32),
        "q_pos": torch.tensor([18, 19, 37, 38, 39], dtype=torch.int32),
    }


def call_micro_attention(args: dict, backend: str) -> None:
    extra = {k: args[k] for k in ("kv_start_pos", "q_pos", "num_splits", "max_query_len", "max_kv_len",
                                  "out_dtype") if k in args}
    micro_attention(
        args["q"], args["kv_pool"], args["layer"], args["block_tables"], args["kv_lens"],
        args["query_start_loc"], backend=args.get("backend", backend), **extra,
    )


def with_(**changes) -> Callable[[dict], None]:
    return lambda args: args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})


I32 = torch.int32
ATTENTION_ERRORS = [
    ("q-2d", with_(q=lambda a: a["q"][:, 0]), r"q must be a 3-D tensor"),
    ("q-heads-not-multiple", with_(q=lambda a: a["q"][:, :3]), r"num_heads \(3\) must be a positive multiple of num_kv_heads \(2\)"),
    ("q-head-dim", with_(q=lambda a: a["q"][..., :32]), r"q head_dim 32 differs from kv_pool head_dim 64"),
    ("q-rows", with_(q=lambda a: a["q"][:4], q_pos=lambda a: a["q_pos"][:4]), r"q_pos has 4 rows, query_start_loc says 5"),
    ("q-rows-decode", with_(q=lambda a: a["q"][:4], q_pos=None, kv_start_pos=None), r"query_start_loc ends at 5 but q has 4 rows"),
    ("q-dtype", with_(q=lambda a: a["q"].half()), r"q is torch.float16 but kv_pool is torch.float32"),
    ("pool-5d", with_(kv_pool=lambda a: a["kv_pool"][0]), r"kv_pool must have shape \[num_blocks, num_layers, 2"),
    ("pool-not-kv", with_(kv_pool=lambda a: a["kv_pool"][:, :, :1]), r"kv_pool must have shape"),
    ("pool-strided", with_(kv_pool=lambda a: a["kv_pool"][::2]), r"kv_pool must be contiguous"),
    ("pool-int", with_(kv_pool=lambda a: a["kv_pool"].to(torch.int16)), r"kv_pool dtype must be float16, bfloat16 or float32"),
    ("layer-high", with_(layer=NUM_LAYERS), r"layer must be an int in \[0, 2\), got 2"),
    ("layer-negative", with_(layer=-1), r"layer must be an int in \[0, 2\), got -1"),
    ("layer-bool", with_(layer=True), r"layer must be an int in \[0, 2\), got True"),
    ("layer-float", with_(layer=1.0), r"layer must be an int in \[0, 2\), got 1.0"),
    ("block-tables-1d", with_(block_tables=lambda a: a["block_tables"][0]), r"block_tables must be a 2-D int32 tensor"),
    ("block-tables-int64", with_(block_tables=lambda a: a["block_tables"].long()), r"block_tables must be int32, got torch.int64"),
    ("block-tables-rows", with_(block_tables=lambda a: a["block_tables"][:1]), r"kv_lens must have shape \[1\], got \[2\]"),
    ("block-tables-strided", with_(block_tables=lambda a: a["block_tables"].t().contiguous().t()), r"block_tables must be contiguous in its last dimension"),
    ("block-id-too-big", with_(block_tables=lambda a: a["block_tables"].index_put((torch.tensor(1), torch.tensor(2)), torch.tensor(8, dtype=I32))), r"block id 8 outside the pool's \[0, 8\)"),
    ("block-id-negative", with_(block_tables=lambda a: a["block_tables"].index_put((torch.tensor(0), torch.tensor(1)), torch.tensor(-1, dtype=I32))), r"block id -1 outside the pool's \[0, 8\)"),
    ("too-few-columns", with_(block_tables=lambda a: a["block_tables"][:, :2].contiguous()), r"sequence 1 holds 40 keys = 3 blocks, but block_tables has only 2 columns"),
    ("kv-lens-shape", with_(kv_lens=torch.tensor([20, 40, 1], dtype=I32)), r"kv_lens must have shape \[2\], got \[3\]"),
    ("kv-lens-int64", with_(kv_lens=lambda a: a["kv_lens"].long()), r"kv_lens must be int32, got torch.int64"),
    ("kv-lens-negative", with_(kv_lens=torch.tensor([-1, 40], dtype=I32)), r"kv_lens must be >= 0"),
    ("qsl-shape", with_(query_start_loc=torch.tensor([0, 5], dtype=I32)), r"query_start_loc must have shape \[3\], got \[2\]"),
    ("qsl-2d", with_(query_start_loc=torch.tensor([[0, 2, 5]], dtype=I32)), r"query_start_loc must have shape \[3\], got \[1, 3\]"),
    ("qsl-float", with_(query_start_loc=torch.tensor([0.0, 2.0, 5.0])), r"query_start_loc must be int32, got torch.float32"),
    ("qsl-decreasing", with_(query_start_loc=torch.tensor([0, 3, 2], dtype=I32), q=lambda a: a["q"][:2], q_pos=lambda a: a["q_pos"][:2]), r"query_start_loc must start at 0 and never decrease"),
    ("qsl-not-from-zero", with_(query_start_loc=torch.tensor([1, 3, 6], dtype=I32), q=lambda a: torch.cat([a["q"], a["q"][:1]]), q_pos=lambda a: torch.cat([a["q_pos"], a["q_pos"][:1]])), r"query_start_loc must start at 0"),
    ("q-pos-2d", with_(q_pos=lambda a: a["q_pos"][None]), r"q_pos must be 1-D \[num_q_tokens\], got shape \[1, 5\]"),
    ("q-pos-int64", with_(q_pos=lambda a: a["q_pos"].long()), r"q_pos must be int32, got torch.int64"),
    ("kv-start-pos-shape", with_(kv_start_pos=torch.tensor([0], dtype=I32)), r"kv_start_pos must have shape \[2\], got \[1\]"),
    ("kv-start-without-q-pos", with_(q_pos=None), r"kv_start_pos is only meaningful with q_pos"),
    ("num-splits-zero", with_(num_splits=0), r"num_splits must be positive, got 0"),
    ("backend", with_(backend="cuda"), r"backend must be 'auto', 'triton' or 'torch', got 'cuda'"),
    ("out-dtype", with_(out_dtype=torch.int32), r"out_dtype must be float16, bfloat16 or float32"),
    ("max-query-len-too-small", with_(max_query_len=1), r"max_query_len 1 is less than the longest query \(3 rows\)"),
    ("max-kv-len-too-small", with_(max_kv_len=16), r"max_kv_len 16 is less than the longest sequence \(40 keys\)"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate, match", [pytest.param(m, r, id=i) for i, m, r in ATTENTION_ERRORS])
def test_micro_attention_rejects(mutate: Callable[[dict], None], match: str, backend: str) -> None:
    args = valid_attention_args()
    call_micro_attention(args, backend)  # the unchanged call is valid
    pool_before = args["kv_pool"].clone()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        call_micro_attention(args, backend)
    pool = args["kv_pool"]
    if pool.shape == pool_before.shape and pool.dtype == pool_before.dtype:
        assert torch.equal(pool, pool_before)


def test_plan_rejects_bad_head_counts() -> None:
    args = valid_attention_args()
    common = dict(head_dim=HEAD_DIM, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    for num_heads, num_kv_heads in ((0, 2), (4, 0), (6, 4)):
        with pytest.raises(ValueError, match=rf"num_heads \({num_heads}\) must be a positive multiple"):
            plan_micro_attention(args["block_tables"], args["kv_lens"], args["query_start_loc"],
                                 num_heads=num_heads, num_kv_heads=num_kv_heads, **common)


@NEEDS_INTERPRETER
def test_max_lengths_that_cover_the_batch_are_accepted() -> None:
    args = valid_attention_args()
    args["max_query_len"], args["max_kv_len"] = 3, 40
    call_micro_attention(args, "triton")
    args["max_query_len"], args["max_kv_len"] = 7, 100
    call_micro_attention(args, "triton")


# --- merge_attention_states ----------------------------------------------------------


def parts(num_parts: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return randn(num_parts, 4, 2, 64, dtype=torch.float32, gen=gen), torch.randn(num_parts, 4, 2, generator=gen)


MERGE_ERRORS = [
    ("empty-out-list", lambda o, l: ([], list(l)), {}, r"needs at least one part"),
    ("empty-lse-list", lambda o, l: (list(o), []), {}, r"needs at least one part"),
    ("zero-parts", lambda o, l: (o[:0], l[:0]), {}, r"needs at least one part"),
    ("out-list-shapes", lambda o, l: ([o[0], o[1, :3]], [l[0], l[1]]), {}, r"out_parts\[1\] is \[3, 2, 64\]"),
    ("out-list-dtypes", lambda o, l: ([o[0], o[1].half()], [l[0], l[1]]), {}, r"out_parts\[1\] is \[4, 2, 64\] torch.float16"),
    ("lse-list-shapes", lambda o, l: ([o[0], o[1]], [l[0], l[1, :, :1]]), {}, r"lse_parts\[1\] is \[4, 1\]"),
    ("out-3d", lambda o, l: (o[0], l), {}, r"out_parts must be \[P, num_tokens, num_heads, head_dim\]"),
    ("lse-shape", lambda o, l: (o, l[:, :3]), {}, r"lse_parts shape \[3, 3, 2\] must be out_parts' first three dims \[3, 4, 2\]"),
    ("part-count", lambda o, l: (o, l[:2]), {}, r"lse_parts shape \[2, 4, 2\]"),
    ("out-int", lambda o, l: (o.int(), l), {}, r"out_parts dtype must be float16, bfloat16 or float32"),
    ("lse-half", lambda o, l: (o, l.half()), {}, r"lse_parts must be float32, got torch.float16"),
    ("lse-base-10", lambda o, l: (o, l), {"lse_base": "10"}, r"lse_base must be 'e' or '2', got '10'"),
    ("lse-base-number", lambda o, l: (o, l), {"lse_base": 2}, r"lse_base must be 'e' or '2', got 2"),
    ("out-dtype", lambda o, l: (o, l), {"out_dtype": torch.float64}, r"out_dtype must be float16, bfloat16 or float32"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("make, kwargs, match", [pytest.param(m, k, r, id=i) for i, m, k, r in MERGE_ERRORS])
def test_merge_rejects(make, kwargs: dict, match: str, backend: str) -> None:
    out_parts, lse_parts = make(*parts())
    with pytest.raises(ValueError, match=match):
        merge_attention_states(out_parts, lse_parts, backend=backend, **kwargs)


# --- write_kv ------------------------------------------------------------------------


def valid_write_args() -> dict:
    gen = torch.Generator().manual_seed(2)
    return {
        "k": randn(4, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, gen=gen),
        "v": randn(4, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, gen=gen),
        "kv_pool": randn(NUM_BLOCKS, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.float16, gen=gen),
        "layer": 0,
        "slot_mapping": torch.tensor([3, 17, 127, 64], dtype=torch.int64),
    }


NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
WRITE_ERRORS = [
    ("slot-past-pool", with_(slot_mapping=torch.tensor([3, 17, NUM_SLOTS, 64])), rf"slot_mapping holds slot 128 outside the pool's \[0, {NUM_SLOTS}\)"),
    ("slot-negative", with_(slot_mapping=torch.tensor([3, -1, 5, 64], dtype=I32)), rf"slot_mapping holds slot -1 outside the pool's \[0, {NUM_SLOTS}\)"),
    ("slot-float", with_(slot_mapping=torch.tensor([3.0, 17.0, 5.0, 64.0])), r"slot_mapping must be an int32 or int64 tensor"),
    ("slot-shape", with_(slot_mapping=torch.tensor([3, 17, 5])), r"slot_mapping must have shape \[4\], got \[3\]"),
    ("k-heads", with_(k=lambda a: torch.cat([a["k"], a["k"][:, :1]], 1)), r"k has 3 heads of dim 64; the pool holds 2 KV heads of dim 64"),
    ("v-head-dim", with_(v=lambda a: a["v"][..., :32]), r"v has 2 heads of dim 32; the pool holds 2 KV heads of dim 64"),
    ("k-2d", with_(k=lambda a: a["k"][:, 0]), r"k must be a 3-D tensor"),
    ("k-dtype", with_(k=lambda a: a["k"].float()), r"k is torch.float32 but kv_pool is torch.float16"),
    ("v-rows", with_(v=lambda a: a["v"][:3]), r"k has 4 rows, v has 3"),
    ("k-strided-dim", with_(k=lambda a: a["k"].transpose(1, 2).contiguous().transpose(1, 2)), r"k must be contiguous in its last dimension"),
    ("layer", with_(layer=2), r"layer must be an int in \[0, 2\), got 2"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate, match", [pytest.param(m, r, id=i) for i, m, r in WRITE_ERRORS])
def test_write_kv_rejects_and_leaves_the_pool_untouched(mutate, match: str, backend: str) -> None:
    args = valid_write_args()
    pool_before = args["kv_pool"].clone()
    mutate(args)
    with pytest.raises(ValueError, match=match):
        write_kv(args["k"], args["v"], args["kv_pool"], args["layer"], args["slot_mapping"], backend=backend)
    assert torch.equal(args["kv_pool"], pool_before)
    # The unchanged call is valid and does write.
    valid = valid_write_args()
    write_kv(valid["k"], valid["v"], valid["kv_pool"], valid["layer"], valid["slot_mapping"], backend=backend)
    assert torch.equal(valid["kv_pool"][0, 0, 0, 3], valid["k"][0])
    assert not math.isclose(float((valid["kv_pool"] != pool_before).sum()), 0.0)
