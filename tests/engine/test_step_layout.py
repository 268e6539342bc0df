"""The step's attention layout: consecutive segments of a request on one instance are one entry."""

from __future__ import annotations

import asyncio
import math

import torch

from infinite_llm.engine.block_manager import Segment
from infinite_llm.engine.dist_attention import DistAttention, InProcessRemoteAttention, build_step_attention
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
