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


def test_static_instances_over_several_gpus_hold_what_one_gpu_cannot():
    # 100K-200K-token prompts: longer than one GPU (64K tokens), shorter than four.
    trace = [Request(i, 0.01 * i, prompt_tokens=100_000 + 20_000 * i, output_tokens=8) for i in range(3)]
    tp4 = ClusterConfig(num_instances=4, blocks_per_instance=4000, tensor_parallel=CLUSTER.tensor_parallel, static_gpus_per_instance=4)
    sim = Simulation(trace, MODEL, tp4, "static")
    result = sim.run()
    assert len(sim.instances) == 1 and sim.instances[0].total == 16000 and sim.instances[0].degree == 4
    assert result.num_finished == 3 and result.num_rejected == 0
    assert simulate(trace, MODEL, CLUSTER, "static").num_rejected == 3
    with pytest.raises(ValueError, match="divide"):
        ClusterConfig(num_instances=4, blocks_per_instance=10, static_gpus_per_instance=3)


def test_infinite_admits_a_request_its_home_cannot_fit_on_spare_memory_elsewhere():
    # Three instances of 100 blocks: A and B take 80 blocks each on instances 0 and 1, C 30 on
    # instance 2; D needs 90 blocks, routed to instance 2 (70 free). Static waits for
    # instance 2 to drain; Infinite-LLM admits D at once, 70 blocks at home, 20 elsewhere.
    cluster = ClusterConfig(num_instances=3, blocks_per_instance=100, block_size=16)
    # A prompt of n * 16 - 2 tokens and its next token fill n blocks, and so do they and the
    # token after: the first step (the run stops after it) opens no block.
    trace = [Request(0, 0.0, 80 * 16 - 2, 50), Request(1, 0.0, 80 * 16 - 2, 50),
             Request(2, 0.0, 30 * 16 - 2, 50), Request(3, 0.0, 90 * 16 - 2, 50)]
    running = {}
    for policy in ("infinite", "static"):
        sim = Simulation(trace, MODEL, cluster, policy, until_s=0.0)
        result = sim.run()
        running[policy] = {r.spec.req_id: dict(r.blocks) for i in sim.instances for r in i.running}
        assert result.num_unfinished == 4 and result.num_finished == 0
    assert running["infinite"][3] == {2: 70, 0: 20}
    assert 3 not in running["static"]
    assert all(i.free >= 0 for i in sim.instances)


def test_window_throughput_counts_tokens_generated_until_the_last_arrival():
    trace = make_trace("short", 120, rate_per_s=40, seed=5)
    full = simulate(trace, MODEL, CLUSTER, "static")
    cut = simulate(trace, MODEL, CLUSTER, "static", until_s=trace[-1].arrival_s)
    assert full.window_s == cut.window_s == pytest.approx(trace[-1].arrival_s - trace[0].arrival_s)
    # Both runs are the same until the window ends; the cut one stops there.
    assert full.window_throughput_tokens_per_s == pytest.approx(cut.window_throughput_tokens_per_s)
    assert cut.window_throughput_tokens_per_s * cut.window_s <= cut.generated_tokens < full.generated_tokens
    assert cut.num_finished + cut.num_rejected + cut.num_unfinished == len(trace) and cut.num_unfinished > 0
    assert full.num_unfinished == 0


def test_modelled_prefill_delays_the_first_token_by_the_prompt_at_the_prefill_rate():
    trace = [Request(0, 0.0, prompt_tokens=10_000, output_tokens=4)]
    without = simulate(trace, MODEL, CLUSTER, "static")
    cluster = ClusterConfig(num_instances=4, blocks_per_instance=4000, prefill_tokens_per_s=10_000.0,
                            prefill_chunk_tokens=4096)
    with_prefill = simulate(trace, MODEL, cluster, "static")
    # Three chunked steps (4096 + 4096 + 1808 tokens) take 1 s of prefill and no decode time
    # (the request is not in the decode batch yet); the third gives the first token, then three
    # decode steps give the rest.
    step_s = without.mean_latency_s / 4
    assert with_prefill.mean_latency_s == pytest.approx(1.0 + 3 * step_s, rel=0.05)
    assert with_prefill.generated_tokens == 4


def test_prefill_chunks_share_one_budget_per_step():
    # Two prompts on one instance: a step prefills at most one chunk of tokens in all, so both
    # together take as long as one prompt of their summed length.
    model_cluster = dict(num_instances=1, blocks_per_instance=4000, prefill_tokens_per_s=1e4, prefill_chunk_tokens=1000)
    both = [Request(0, 0.0, 3000, 2), Request(1, 0.0, 3000, 2)]
    one = [Request(0, 0.0, 6000, 2)]
    steps_both = simulate(both, MODEL, ClusterConfig(**model_cluster), "static").makespan_s
    steps_one = simulate(one, MODEL, ClusterConfig(**model_cluster), "static").makespan_s
    assert steps_both == pytest.approx(steps_one, rel=0.1)
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        ClusterConfig(num_instances=1, blocks_per_instance=10, prefill_tokens_per_s=0.0)


@pytest.mark.parametrize("memory", ["ample", "tight"])
@pytest.mark.parametrize("policy", ["static", "infinite"])
@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_a_running_request_holds_its_context_and_next_token_slot_at_every_step(block_size, policy, memory):
    # A request holds ceil((context + 1) / B) blocks: the KV of its context and the slot its next
    # token is written to, no more and no fewer, from admission to its last step. Prompts on,
    # just before and just after block boundaries, outputs long enough to cross several. Tight
    # memory (room for the longest request and one block more per instance) makes requests grow
    # through moves (infinite) and come back from preemption (both).
    b = block_size
    output = 3 * b + 2
    prompts = sorted({1, b - 1, b, b + 1, 2 * b, 2 * b + 1, 3 * b - 1} - {0})
    trace = [Request(i, 0.0, prompt, output) for i, prompt in enumerate(prompts)]
    blocks_per_instance = 4000 if memory == "ample" else max(-(-(p + output) // b) for p in prompts) + 1
    cluster = ClusterConfig(num_instances=2, blocks_per_instance=blocks_per_instance, block_size=b)
    sim = Simulation(trace, MODEL, cluster, policy)
    seen: list[tuple[int, int, int]] = []  # (req_id, context, blocks)

    def check(inst) -> None:
        for req in inst.running:
            blocks = sum(req.blocks.values())
            seen.append((req.spec.req_id, req.context, blocks))
            assert blocks == -(-(req.context + 1) // b), (req.spec.req_id, req.context, req.blocks)

    admit, step = sim._admit, sim._step

    def admit_and_check(inst) -> None:
        admit(inst)
        check(inst)

    def step_and_check(inst) -> None:
        step(inst)
        check(inst)

    sim._admit, sim._step = admit_and_check, step_and_check
    result = sim.run()
    assert result.num_finished == len(trace)
    if memory == "tight":
        assert result.num_preemptions > 0 and (result.num_moves > 0) == (policy == "infinite")
    # Every request was seen at every context from its prompt to its last step's.
    for i, prompt in enumerate(prompts):
        contexts = {context for req_id, context, _ in seen if req_id == i}
        assert contexts == set(range(prompt, prompt + output))
