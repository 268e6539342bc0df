"""A KV move travels as one buffer per run of consecutive destination blocks."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from infinite_llm.transport.block_runs import destination_runs
from infinite_llm.transport.kv_packing import pack_kv_runs


def test_runs_follow_the_destinations_whatever_the_sources():
    runs = destination_runs([7, 2, 9, 10, 4], [20, 21, 22, 30, 31])
    assert [(r.dst_block_id, r.src_block_ids) for r in runs] == [(20, (7, 2, 9)), (30, (10, 4))]
    assert [r.src_consecutive for r in runs] == [False, False]
    assert destination_runs([3, 4, 5], [0, 1, 2])[0].src_consecutive


def test_run_length_is_capped():
    runs = destination_runs(list(range(5)), list(range(5)), max_run_blocks=2)
    assert [r.num_blocks for r in runs] == [2, 2, 1]


@given(st.lists(st.integers(0, 63), min_size=1, max_size=24, unique=True),
       st.lists(st.integers(0, 63), min_size=1, max_size=24, unique=True))
def test_packed_buffers_land_every_block_where_it_belongs(sources, destinations):
    n = min(len(sources), len(destinations))
    sources, destinations = sources[:n], destinations[:n]
    pool = torch.randn(64, 3, 2, 4, 2, 8)  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    runs, buffers = pack_kv_runs(pool, sources, destinations)
    received = torch.full_like(pool, float("nan"))
    for run, buffer in zip(runs, buffers, strict=True):
        assert buffer.is_contiguous() and buffer.shape == (run.num_blocks, *pool.shape[1:])
        received[run.dst_block_id:run.dst_block_id + run.num_blocks] = buffer
    for src, dst in zip(sources, destinations):
        assert torch.equal(received[dst], pool[src])
    assert len(runs) == len(destination_runs(sources, destinations))


def test_consecutive_sources_are_views_not_copies():
    pool = torch.randn(16, 2, 2, 4, 1, 8)
    _, buffers = pack_kv_runs(pool, [4, 5, 6], [0, 1, 2])
    assert buffers[0].data_ptr() == pool[4].data_ptr()
