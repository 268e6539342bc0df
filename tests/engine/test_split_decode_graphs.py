"""A split decode step as one body, remote parts included (``SplitDecodeGraphs``), run eagerly
on the CPU: the home's rows, entries and parts laid out as the graph captures them, and greedy
tokens identical to one pool's. The creditors are the in-process pools, each attending over its
own blocks when the home announces a layer's query (on a GPU a mailbox's flag does that; the
graph itself is tested there, ``tests/daemon/test_cluster_mailboxes.py``)."""

from __future__ import annotations

import pytest
import torch

from infinite_llm.engine.config import EngineConfig
from infinite_llm.engine.cuda_graphs import DEFAULT_BATCH_SIZES, SplitDecodeGraphs
from infinite_llm.engine.dist_attention import DevicePart, InProcessRemoteAttention, _plan
from infinite_llm.engine.engine import LLMEngine
from infinite_llm.kernels import run_micro_attention

from test_engine_distributed import _greedy

MAX_ROWS = 8


class PoolPart(DevicePart):
    """An in-process pool taking one step's layers: it attends for the rows its batch names
    when a layer's query is announced, into its result slots."""

    def __init__(self, instance_id: int, pool: torch.Tensor, num_layers: int, num_heads: int, head_dim: int,
                 sm_scale: float) -> None:
        self.key = ("pool", instance_id)
        self.pool = pool
        self.q = torch.full((num_layers, MAX_ROWS, num_heads, head_dim), float("nan"), dtype=pool.dtype)
        # Slots past the batch's rows hold what a mailbox may: anything. NaN shows a row read
        # that should not be.
        self.out = torch.full_like(self.q, float("nan"))
        self.lse = torch.full((num_layers, MAX_ROWS, num_heads), float("nan"))
        self.sm_scale = sm_scale
        self.plan = None
        self.num_rows = 0
        self.layers_served = 0

    def begin(self, batch, num_heads: int, wire_rows: int) -> None:
        self.plan = _plan(batch, self.pool, num_heads)
        self.num_rows = batch.num_rows_host
        self.wire_rows = wire_rows

    def announce_query(self, layer: int, rows: int) -> None:
        # What the step's StepBegin told an NCCL link: a send and its receive are one size.
        assert rows == self.wire_rows >= self.num_rows, (rows, self.wire_rows, self.num_rows)
        n = self.num_rows
        state = run_micro_attention(self.plan, self.q[layer, :n], self.pool, layer, sm_scale=self.sm_scale,
                                    out_dtype=self.pool.dtype)
        self.out[layer, :n] = state.out
        self.lse[layer, :n] = state.lse
        self.layers_served += 1

    def await_result(self, layer: int, rows: int) -> None:
        assert rows == self.wire_rows, (rows, self.wire_rows)  # served at once, in order


class PoolsOnDevice(InProcessRemoteAttention):
    """In-process creditor pools that take whole steps (``begin_device_step``)."""

    def __init__(self, engine: LLMEngine) -> None:
        mc = engine.model_config
        creditors = {i: p for i, p in enumerate(engine.pools) if i != engine.home_instance_id}
        super().__init__(creditors, num_heads=mc.num_heads)
        self.parts = {i: PoolPart(i, p, mc.num_layers, mc.num_heads, mc.head_dim, engine.model.sm_scale)
                      for i, p in creditors.items()}

    device_part_rows = MAX_ROWS

    def begin_device_step(self, batches, wire_rows=None):
        if any(b.num_rows_host > MAX_ROWS for b in batches):
            return None
        for batch, rows in zip(batches, wire_rows):
            self.parts[batch.instance_id].begin(batch, self._num_heads, rows)
        return [self.parts[b.instance_id] for b in batches]

    def live_device_parts(self):
        return {part.key for part in self.parts.values()}


def engine_with_step_bodies(smollm2, config: EngineConfig) -> tuple[LLMEngine, SplitDecodeGraphs, PoolsOnDevice]:
    engine = LLMEngine(smollm2, config)
    remote = engine.remote = PoolsOnDevice(engine)
    (padding_block,) = engine.block_manager.reserve_home_blocks(1)
    sizes = tuple(b for b in DEFAULT_BATCH_SIZES if b < config.max_num_seqs) + (config.max_num_seqs,)
    graphs = engine.split_decode_graphs = SplitDecodeGraphs(
        engine.model, engine.pools[engine.home_instance_id], padding_block * config.block_size, sizes,
        -(-engine.max_model_len // config.block_size), use_graphs=False)
    return engine, graphs, remote


@pytest.fixture(scope="module")
def single_pool_tokens(smollm2, prompt_token_ids):
    engine = LLMEngine(smollm2, EngineConfig(pool_blocks=(1024,), max_num_batched_tokens=512))
    tokens, _ = _greedy(engine, prompt_token_ids[:4], 10)
    return tokens


def test_one_request_split_in_two_merges_two_parts(smollm2, prompt_token_ids, single_pool_tokens):
    engine, graphs, remote = engine_with_step_bodies(smollm2, EngineConfig(
        block_size=4, pool_blocks=(256, 64), max_num_batched_tokens=512, spill_to_creditors=False))

    def lend_once(engine, step):
        if step == 2:
            engine.lend("0", 1, 1)

    tokens, _ = _greedy(engine, prompt_token_ids[:1], 10, lend_once)
    assert tokens == single_pool_tokens[:1]
    # Every decode step after the lend ran as one body, through the two-part merge.
    assert graphs.eager_steps >= 6
    assert all(key[4] for key in graphs._steps), list(graphs._steps)
    assert remote.parts[1].layers_served == graphs.eager_steps * engine.model_config.num_layers


def test_one_request_over_three_pools_merges_its_parts_in_a_chain(smollm2, prompt_token_ids, single_pool_tokens):
    """A request with parts at home and on two creditors: every row in row order on all three,
    so the step merges two parts at a time where they lie (no gather or scatter)."""
    engine, graphs, remote = engine_with_step_bodies(smollm2, EngineConfig(
        block_size=4, pool_blocks=(256, 64, 64), max_num_batched_tokens=512, spill_to_creditors=False))

    def lend(engine, step):
        if step in (2, 3):
            engine.lend("0", 1, 1 if step == 2 else 2)

    tokens, _ = _greedy(engine, prompt_token_ids[:1], 10, lend)
    assert tokens == single_pool_tokens[:1]
    aligned_three = [key for key in graphs._steps if key[3] == 3 and key[4] and len(key[5]) == 2]
    assert aligned_three, list(graphs._steps)
    assert all(part.layers_served > 0 for part in remote.parts.values())


@pytest.mark.parametrize("num_requests", [3, 4])  # 3: a padded row in a batch of 4
def test_requests_over_three_pools_merge_every_rows_parts(smollm2, prompt_token_ids, single_pool_tokens, num_requests):
    """Requests in a batch: "0" with parts on both creditors and at home (three parts), "1" on
    the second creditor and at home, the others all at home (rows no creditor attends for)."""
    engine, graphs, remote = engine_with_step_bodies(smollm2, EngineConfig(
        block_size=4, pool_blocks=(256, 96, 96), max_num_batched_tokens=512, spill_to_creditors=False))

    def lend(engine, step):
        if step in (2, 4):
            engine.lend("0", 1, 1 if step == 2 else 2)
        if step == 3:
            engine.lend("1", 1, 2)

    tokens, _ = _greedy(engine, prompt_token_ids[:num_requests], 10, lend)
    assert tokens == single_pool_tokens[:num_requests]
    assert graphs.eager_steps >= 6
    assert any(key[3] == 3 and len(key[5]) == 2 for key in graphs._steps), list(graphs._steps)
    assert all(part.layers_served > 0 for part in remote.parts.values())
