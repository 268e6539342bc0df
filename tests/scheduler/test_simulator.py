"""Simulator sanity: every request finishes, memory is never exceeded, baselines behave."""

import pytest

from infinite_llm.scheduler.perf_model import TensorParallelModel
from infinite_llm.scheduler.simulator import (
    ClusterConfig,
    Request,
    Simulation,
    gpu_roofline_model,
    make_trace,
    simulate,
)

MODEL = gpu_roofline_model()
CLUSTER = ClusterConfig(
    num_instances=4, blocks_per_instance=4000, block_size=16,
    tensor_parallel=TensorParallelModel(num_kv_heads=8, hidden_size=4096),
)


@pytest.fixture(scope="module")
def long_trace():
    # 2% of prompts are 100K-200K tokens: longer than one instance (64K tokens).
    return make_trace("long", 200, rate_per_s=50, seed=3, max_long_tokens=200_000, long_fraction=0.05)


@pytest.mark.parametrize("policy", ["infinite", "static", "single"])
def test_every_request_finishes_or_is_rejected_and_memory_holds(policy, long_trace):
    sim = Simulation(long_trace, MODEL, CLUSTER, policy)
    result = sim.run()
    assert result.num_finished + result.num_rejected == len(long_trace)
    # A preempted request keeps its tokens (its KV is recomputed), so nothing is generated twice.
    assert result.generated_tokens == sum(r.spec.output_tokens for r, _ in sim.finished)
    assert 0 < result.peak_used_fraction <= 1.0
    # All memory is back once the trace is done.
    assert all(i.free == i.total and i.hosted_blocks == 0 and not i.running for i in sim.instances)
    if policy == "infinite":
        assert result.num_rejected == 0 and result.num_moves > 0
    if policy == "static":
        too_long = [r for r in long_trace if -(-(r.prompt_tokens + r.output_tokens) // 16) > 4000]
        assert result.num_rejected == len(too_long) > 0
        assert result.num_moves == 0 and result.blocks_moved == 0
    if policy == "single":
        assert result.num_rejected == 0 and result.num_moves == 0


def test_short_trace_all_policies_finish_everything():
    trace = make_trace("short", 150, rate_per_s=100, seed=4)
    results = {p: simulate(trace, MODEL, CLUSTER, p) for p in ("infinite", "static", "single")}
    for result in results.values():
        assert result.num_finished == 150 and result.num_rejected == 0
        assert result.generated_tokens == sum(r.output_tokens for r in trace)
        assert result.throughput_tokens_per_s > 0 and result.mean_latency_s > 0


def test_a_request_longer_than_every_instance_spreads_over_the_cluster():
    trace = [Request(0, 0.0, prompt_tokens=150_000, output_tokens=20)]
    result = simulate(trace, MODEL, CLUSTER, "infinite")
    assert result.num_finished == 1 and result.peak_used_fraction == 1.0
    assert simulate(trace, MODEL, CLUSTER, "static").num_rejected == 1


def test_simulation_is_deterministic_and_rejects_unknown_policies(long_trace):
    assert simulate(long_trace, MODEL, CLUSTER, "infinite") == simulate(long_trace, MODEL, CLUSTER, "infinite")
    with pytest.raises(ValueError, match="policy"):
        simulate(long_trace, MODEL, CLUSTER, "vllm")
    with pytest.raises(ValueError, match="kind"):
        make_trace("medium", 1, 1.0)
