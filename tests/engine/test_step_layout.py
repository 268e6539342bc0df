"""The step's attention layout: consecutive segments of a request on one instance are one entry."""

from __future__ import annotations

import asyncio
import math

import torch

from infinite_llm.engine.block_manager import Segment
from infinite_llm.engine.dist_attention import (BlockIdArrays, DistAttention, InProcessRemoteAttention,
                                                build_step_attention)
from infinite_llm.engine.scheduler import ScheduledChunk

BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, NUM_LAYERS = 4, 4, 2, 8, 2


def test_consecutive_full_segments_on_one_instance_are_one_entry() -> None:
    # Tokens 0-7 and 8-11 on instance 1 (two spills), 12-13 at home, and the decode row at 13.
    table = (Segment(1, (5, 6), 0, 8), Segment(1, (2,), 8, 4), Segment(0, (9,), 12, 2))
    step = build_step_attention(0, [ScheduledChunk("r", 13, 1, True)], {"r": table}, [9 * BLOCK_SIZE + 1],
                                home_instance_id=0, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    assert step.num_parts == 2
    creditor = step.batches[1]
    assert creditor.block_tables.tolist() == [[5, 6, 2]] and creditor.kv_lens.tolist() == [12]
    assert creditor.entry_keys == (("r", 0),)  # read from segment 0 on
    assert (step.placements[1].part, step.placements[0].part) == (0, 1)
    assert step.placements[1].all_rows and step.placements[0].all_rows


def test_segments_with_a_gap_or_a_partial_block_stay_apart() -> None:
    gap = (Segment(1, (5,), 0, 4), Segment(2, (7,), 4, 4), Segment(1, (6,), 8, 4), Segment(0, (9,), 12, 2))
    partial = (Segment(1, (5, 6), 0, 6), Segment(1, (2,), 6, 4), Segment(0, (9,), 10, 2))
    for table, parts in ((gap, 4), (partial, 3)):
        last = table[-1].token_end - 1
        step = build_step_attention(0, [ScheduledChunk("r", last, 1, True)], {"r": table}, [9 * BLOCK_SIZE + 1],
                                    home_instance_id=0, block_size=BLOCK_SIZE, device=torch.device("cpu"))
        assert step.num_parts == parts


def test_a_row_over_coalesced_segments_attends_exactly() -> None:
    """Two pools standing for a home and one creditor; the creditor holds two consecutive
    segments: the merged output equals attention over all keys."""
    g = torch.Generator().manual_seed(3)
    pools = {i: torch.randn(16, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g) for i in (0, 1)}
    table = (Segment(1, (5, 6), 0, 8), Segment(1, (2,), 8, 4), Segment(0, (9, 3), 12, 6))
    layer, pos = 1, 17
    step = build_step_attention(0, [ScheduledChunk("r", pos, 1, True)], {"r": table}, [3 * BLOCK_SIZE + 1],
                                home_instance_id=0, block_size=BLOCK_SIZE, device=torch.device("cpu"))
    remote = InProcessRemoteAttention({1: pools[1]}, num_heads=NUM_HEADS)
    attention = DistAttention(step, pools[0], 0, remote, num_heads=NUM_HEADS, sm_scale=HEAD_DIM**-0.5)
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, generator=g)
    new_k = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, generator=g)
    new_v = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, generator=g)
    out = asyncio.run(attention(layer, q, new_k, new_v))

    keys, values = [], []
    for segment in table:
        for t in range(segment.num_tokens):
            block = segment.block_ids[t // BLOCK_SIZE]
            keys.append(pools[segment.instance_id][block, layer, 0, t % BLOCK_SIZE])
            values.append(pools[segment.instance_id][block, layer, 1, t % BLOCK_SIZE])
    k = torch.stack(keys).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).double()  # [pos + 1, H, D]
    v = torch.stack(values).repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1).double()
    scores = torch.einsum("hd,nhd->hn", q[0].double(), k) / math.sqrt(HEAD_DIM)
    want = torch.einsum("hn,nhd->hd", torch.softmax(scores, -1), v)
    torch.testing.assert_close(out[0].double(), want, rtol=1e-5, atol=1e-5)


def test_block_ids_are_made_arrays_once_and_kept_while_steps_ask_for_them() -> None:
    arrays = BlockIdArrays()
    home_blocks = tuple(range(100, 140))
    first = arrays.of(home_blocks)
    arrays.end_step()
    assert arrays.of(home_blocks) is first  # the same tuple: the same array
    assert arrays.of(tuple(home_blocks)) is first  # tuple() of a tuple is the tuple itself
    grown = home_blocks + (7,)
    assert arrays.of(grown).tolist() == [*home_blocks, 7]
    arrays.end_step()
    arrays.end_step()  # a step that did not ask for them: dropped
    assert arrays.of(home_blocks) is not first and arrays.of(home_blocks).tolist() == list(home_blocks)
    assert not arrays.of(home_blocks).flags.writeable


def test_layouts_with_kept_arrays_match_fresh_ones_step_after_step() -> None:
    """A request decoding over a creditor's segments and a growing home tail, beside a
    prefill chunk: every step's layout is the same with the engine's kept arrays as without."""
    kept = BlockIdArrays()
    creditor = (Segment(1, (5, 6), 0, 8), Segment(1, (2,), 8, 4))
    home_blocks: tuple[int, ...] = (9,)
    for pos in range(12, 30):
        if pos - 12 >= len(home_blocks) * BLOCK_SIZE:
            home_blocks = home_blocks + (20 + len(home_blocks),)
        tables = {"r": (*creditor, Segment(0, home_blocks, 12, pos + 1 - 12)),
                  "p": (Segment(0, (40, 41, 42), 0, 10),)}
        chunks = [ScheduledChunk("r", pos, 1, True), ScheduledChunk("p", 4, 6, True)]
        slots = [home_blocks[-1] * BLOCK_SIZE, *range(41 * BLOCK_SIZE, 41 * BLOCK_SIZE + 6)]
        steps = [build_step_attention(pos, chunks, tables, slots, home_instance_id=0, block_size=BLOCK_SIZE,
                                      device=torch.device("cpu"), block_arrays=arrays)
                 for arrays in (kept, None)]
        with_kept, fresh = steps
        assert with_kept.num_parts == fresh.num_parts == 2
        assert torch.equal(with_kept.slot_mapping, fresh.slot_mapping)
        for inst in (0, 1):
            a, b = with_kept.batches[inst], fresh.batches[inst]
            for name in ("block_tables", "kv_lens", "kv_start_pos", "query_start_loc"):
                assert torch.equal(getattr(a, name), getattr(b, name)), name
            assert a.entry_keys == b.entry_keys and a.entry_rows == b.entry_rows
            assert torch.equal(with_kept.placements[inst].rows, fresh.placements[inst].rows)
            assert torch.equal(with_kept.placements[inst].parts, fresh.placements[inst].parts)
        home = with_kept.batches[0]
        assert home.block_tables[0, :len(home_blocks)].tolist() == list(home_blocks)
        assert home.kv_lens.tolist() == [pos + 1 - 12, 10]
        assert home.entry_rows == ((0, 1, pos + 1 - 12), (1, 6, 10))
        assert home.q_pos.tolist() == [pos, 4, 5, 6, 7, 8, 9]  # the prefill chunk needs its mask
        assert with_kept.batches[1].entry_rows == ((0, 1, 12),)
        assert with_kept.batches[1].block_tables.tolist() == [[5, 6, 2]]
