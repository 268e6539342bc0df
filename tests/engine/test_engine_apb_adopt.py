"""A request whose document KV an APB prefill wrote where it lies decodes over it.

The chunks are prefilled by ``apb_prefill`` (hosts as coroutines of one process), each into
blocks of its own pool (a creditor pool for chunk 0, the home pool for the last), and the
engine adopts them as the request's segments: the query is computed over them, then decoding
runs DistAttention over every pool. With passing blocks that drop nothing APB is exact, so the
greedy tokens must be those of an exact prefill of the same tokens.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.engine.sampling import SamplingParams
from infinite_llm.engine.block_manager import Segment
from infinite_llm.engine.seq_parallel import APBConfig, LocalHostGroup, apb_prefill
from infinite_llm.kernels import write_kv


def long_document(num_items: int) -> str:
    cities = ["Lyon", "Oslo", "Quito", "Perth", "Kyoto", "Cairo", "Lima", "Turin", "Dakar", "Riga"]
    return "\n".join(f"Box {i}: a carved animal sent from {cities[(i * i) % 10]}." for i in range(num_items))

BLOCK = 16
NEW_TOKENS = 8


def prefill_chunks_into_pools(engine: LLMEngine, doc: list[int], query: list[int], bounds: list[int],
                              pools: list[int], config: APBConfig) -> list[Segment]:
    """APB over ``len(pools)`` hosts, host r's chunk written into pool ``pools[r]``; its segments."""
    bm = engine.block_manager
    num_hosts = len(pools)
    groups = LocalHostGroup.create(num_hosts)
    segments = []
    for rank, pool_id in enumerate(pools):
        length = bounds[rank + 1] - bounds[rank]
        block_ids = bm.reserve_blocks(pool_id, -(-length // BLOCK))
        segments.append(Segment(pool_id, tuple(block_ids), bounds[rank], length))

    async def host(rank: int) -> None:
        segment = segments[rank]
        positions = torch.arange(segment.num_tokens)
        slots = torch.tensor(segment.block_ids)[positions // BLOCK] * BLOCK + positions % BLOCK
        pool = engine.pools[segment.instance_id]

        def sink(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            write_kv(k, v, pool, layer, slots, backend="torch")

        def ids(tokens: list[int]) -> torch.Tensor:
            return torch.tensor(tokens, dtype=torch.int64)

        await apb_prefill(engine.model, groups[rank], ids(doc[bounds[rank]:bounds[rank + 1]]),
                          ids(doc[:config.anchor_len]), ids(query), config, kv_sink=sink)

    async def everyone() -> None:
        await asyncio.gather(*(host(r) for r in range(num_hosts)))

    asyncio.run(everyone())
    return segments


def greedy(engine: LLMEngine, request_id: str) -> list[int]:
    tokens = []
    while engine.has_unfinished:
        for output in engine.step():
            if output.request_id == request_id:
                tokens += output.new_token_ids
    return tokens


@pytest.mark.parametrize("num_hosts", [2, 3])
def test_adopted_apb_segments_decode_as_exact_prefill_does(smollm2, num_hosts):
    tokenizer = smollm2.tokenizer
    doc = tokenizer.encode(long_document(80))[:600]
    query = tokenizer.encode(" Question: which city sent Box 7? Answer:", add_special_tokens=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    config = EngineConfig(block_size=BLOCK, pool_blocks=(96,) * num_hosts, max_num_batched_tokens=256)

    reference = LLMEngine(smollm2, config)
    rid = reference.add_request(doc + query, params)
    expected = greedy(reference, rid)

    engine = LLMEngine(smollm2, config)
    inner = [(r * len(doc) // num_hosts) // BLOCK * BLOCK for r in range(1, num_hosts)]
    bounds = [0, *inner, len(doc)]
    # Chunk r on creditor pool r + 1, the last on the home pool (0): the request's tail.
    pools = [r + 1 for r in range(num_hosts - 1)] + [0]
    segments = prefill_chunks_into_pools(engine, doc, query, bounds, pools,
                                         APBConfig(anchor_len=0, passing_len=len(doc)))
    engine.add_prefilled_request(doc + query, params, "apb", segments, num_computed_tokens=len(doc))
    assert engine.placement("apb")[0].instance_id == 1
    assert greedy(engine, "apb") == expected
    # Every block came back: the adopted ones were the request's.
    assert [engine.block_manager.num_free_blocks(i) for i in range(num_hosts)] == [96] * num_hosts


def test_adopt_refuses_a_table_with_a_gap(smollm2):
    engine = LLMEngine(smollm2, EngineConfig(block_size=BLOCK, pool_blocks=(32, 32)))
    bm = engine.block_manager
    first, last = bm.reserve_blocks(1, 2), bm.reserve_blocks(0, 2)
    with pytest.raises(ValueError, match="follow each other"):
        engine.add_prefilled_request(list(range(1, 80)), SamplingParams(max_tokens=2), "gap",
                                     [Segment(1, tuple(first), 0, 32), Segment(0, tuple(last), 48, 16)], 64)
    assert "gap" not in engine.scheduler.requests and not engine.has_unfinished
    with pytest.raises(ValueError, match="leave at least one"):
        engine.add_prefilled_request(list(range(1, 33)), SamplingParams(max_tokens=2), "all",
                                     [Segment(1, tuple(first), 0, 32)], 32)
