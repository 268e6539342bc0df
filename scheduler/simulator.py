"""A discrete-event cluster simulator driven by the perf model and the placement policy.

Three policies over the same GPUs and trace:

* ``"infinite"``: N instances; a request's KV may span instances (DistAttention); the gManager
  runs :func:`.policy.plan` every ``plan_period_s`` and its moves apply at once; a request
  longer than one instance's memory is admitted with its home holding what fits and the rest
  on the emptiest instances; a running request that needs a block its home lacks moves its
  oldest local block to the emptiest instance.
* ``"static"`` (vLLM-multi): N instances that never borrow. A request longer than one
  instance's memory is rejected; a request that needs a block its home lacks preempts the
  newest request of that instance (vLLM's recompute preemption: its KV is dropped, it queues
  again at the front).
* ``"single"`` (vLLM-single): one instance over all N GPUs by tensor parallelism
  (:class:`.perf_model.TensorParallelModel`): pooled memory (divided by the KV-head
  replication past ``num_kv_heads`` GPUs), dense layers split N ways plus two all-reduces per
  layer, attention split over at most ``num_kv_heads`` GPUs.

Every instance runs decode steps back to back; a step's time is the perf model's per-layer
time of the instance's state at the step's start, times the number of layers. Each step gives
every running request one token. What it leaves out: prefill time (a prompt's KV appears at
admission), the time of moving blocks, and the coupling of a debtor's step to its creditors'
business beyond the model's ``max(local, remote part)``.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal, Sequence

import numpy as np

from .perf_model import PerfModel, TensorParallelModel, instance_layer_time
from .policy import ClusterSnapshot, InstanceState, PlacementTable, Thresholds, plan

Policy = Literal["infinite", "static", "single"]


@dataclass(frozen=True)
class Request:
    """One request of a trace."""

    req_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class ClusterConfig:
    """The GPUs being simulated."""

    num_instances: int
    blocks_per_instance: int  # KV memory of one GPU, in blocks
    block_size: int = 16  # tokens per block
    max_batch_per_instance: int = 256
    plan_period_s: float = 0.5  # gManager period (infinite only)
    thresholds: Thresholds = field(default_factory=lambda: Thresholds(debtor_max_batch=32, creditor_max_used_fraction=0.9, max_moves=64))
    tensor_parallel: TensorParallelModel | None = None  # for "single"; None: no all-reduce cost, no replication


@dataclass(frozen=True)
class SimResult:
    """What one simulated run measured. Times in simulated seconds."""

    policy: str
    num_requests: int
    num_finished: int
    num_rejected: int  # could never fit (static: longer than one instance's memory)
    generated_tokens: int
    makespan_s: float  # first arrival to last finish
    throughput_tokens_per_s: float  # generated tokens / makespan
    mean_latency_s: float
    p99_latency_s: float
    mean_per_token_latency_s: float  # latency / output tokens, averaged over requests
    num_moves: int  # blocks moved by plans and spills (infinite)
    blocks_moved: int
    num_preemptions: int
    peak_used_fraction: float  # highest memory use of any instance at any step


class _Req:
    __slots__ = ("spec", "home", "context", "generated", "blocks", "admitted")

    def __init__(self, spec: Request) -> None:
        self.spec = spec
        self.home = -1
        self.context = 0  # KV tokens
        self.generated = 0
        self.blocks: dict[int, int] = {}  # instance -> blocks held there; the home's are the newest
        self.admitted = False


class _Instance:
    __slots__ = ("idx", "total", "free", "running", "queue", "busy", "hosted_blocks")

    def __init__(self, idx: int, total: int) -> None:
        self.idx, self.total, self.free = idx, total, total
        self.running: list[_Req] = []
        self.queue: deque[_Req] = deque()
        self.busy = False
        self.hosted_blocks = 0  # blocks held here for requests homed elsewhere


class Simulation:
    """One run of a trace under one policy. Use :func:`simulate`."""

    def __init__(self, trace: Sequence[Request], model: PerfModel, cluster: ClusterConfig, policy: Policy) -> None:
        if policy not in ("infinite", "static", "single"):
            raise ValueError(f"policy must be 'infinite', 'static' or 'single', got {policy!r}")
        self.model, self.cluster, self.policy = model, cluster, policy
        self.trace = sorted(trace, key=lambda r: (r.arrival_s, r.req_id))
        self.B = cluster.block_size
        if policy == "single":
            tp = cluster.tensor_parallel
            replication = tp.kv_replication(cluster.num_instances) if tp else 1.0
            blocks = int(cluster.num_instances * cluster.blocks_per_instance / replication)
            self.instances = [_Instance(0, blocks)]
            self.max_batch = cluster.max_batch_per_instance * cluster.num_instances
        else:
            self.instances = [_Instance(i, cluster.blocks_per_instance) for i in range(cluster.num_instances)]
            self.max_batch = cluster.max_batch_per_instance
        self.events: list[tuple[float, int, int, int]] = []  # (time, order, kind, index)
        self.order = 0
        self.now = 0.0
        self.finished: list[tuple[_Req, float]] = []
        self.rejected = 0
        self.num_moves = self.blocks_moved = self.preemptions = 0
        self.generated = 0
        self.peak_used = 0.0

    # -- events -----------------------------------------------------------------------------
    _ARRIVAL, _STEP, _PLAN = 0, 1, 2

    def _push(self, time: float, kind: int, index: int) -> None:
        self.order += 1
        heapq.heappush(self.events, (time, self.order, kind, index))

    def run(self) -> SimResult:
        for i, request in enumerate(self.trace):
            self._push(request.arrival_s, self._ARRIVAL, i)
        if self.policy == "infinite" and self.trace:
            self._push(self.trace[0].arrival_s + self.cluster.plan_period_s, self._PLAN, 0)
        pending = len(self.trace)
        while self.events:
            self.now, _, kind, index = heapq.heappop(self.events)
            if kind == self._ARRIVAL:
                self._arrive(self.trace[index])
            elif kind == self._STEP:
                self._step(self.instances[index])
            else:
                self._plan()
                if len(self.finished) + self.rejected < pending:
                    self._push(self.now + self.cluster.plan_period_s, self._PLAN, 0)
            if len(self.finished) + self.rejected == pending and kind != self._ARRIVAL:
                break
        return self._result()

    def _wake(self, inst: _Instance) -> None:
        if not inst.busy:
            self._admit(inst)
            if inst.running:
                inst.busy = True
                self._push(self.now, self._STEP, inst.idx)

    # -- arrival and admission --------------------------------------------------------------
    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.B)

    def _arrive(self, spec: Request) -> None:
        req = _Req(spec)
        need = self._blocks(spec.prompt_tokens + spec.output_tokens)
        capacity = sum(i.total for i in self.instances)
        if need > capacity or (self.policy == "static" and need > self.cluster.blocks_per_instance):
            self.rejected += 1
            return
        # Route to the instance with the most memory not yet promised to its queue.
        home = max(self.instances, key=lambda i: (i.free - sum(self._blocks(r.spec.prompt_tokens + 1) for r in i.queue), -i.idx))
        home.queue.append(req)
        self._wake(home)

    def _admit(self, inst: _Instance) -> None:
        while inst.queue and len(inst.running) < self.max_batch:
            req = inst.queue[0]
            context = req.spec.prompt_tokens + req.generated
            need = self._blocks(context + 1)
            if need <= inst.free:
                placement = {inst.idx: need}
            elif self.policy == "infinite" and need > inst.total and inst.free >= 1:
                placement = self._spread(inst, need)
                if placement is None:
                    return
            else:
                return
            inst.queue.popleft()
            req.home, req.context, req.admitted = inst.idx, context, True
            for idx, n in placement.items():
                self._take(idx, n, hosted=idx != inst.idx)
                req.blocks[idx] = req.blocks.get(idx, 0) + n
            inst.running.append(req)

    def _spread(self, home: _Instance, need: int) -> dict[int, int] | None:
        """A request longer than its home's memory: the home keeps what fits, the rest goes to
        the emptiest other instances."""
        others = sorted((i for i in self.instances if i is not home), key=lambda i: (-i.free, i.idx))
        if home.free + sum(i.free for i in others) < need:
            return None
        placement = {home.idx: home.free}
        left = need - home.free
        for other in others:
            if left == 0:
                break
            n = min(left, other.free)
            if n:
                placement[other.idx] = n
                left -= n
        return placement

    def _take(self, idx: int, n: int, hosted: bool) -> None:
        inst = self.instances[idx]
        if n > inst.free:
            raise AssertionError(f"instance {idx} over its memory")
        inst.free -= n
        if hosted:
            inst.hosted_blocks += n
        self.peak_used = max(self.peak_used, 1 - inst.free / inst.total)

    def _release(self, req: _Req) -> None:
        for idx, n in req.blocks.items():
            inst = self.instances[idx]
            inst.free += n
            if idx != req.home:
                inst.hosted_blocks -= n
                if inst.queue:
                    self._wake(inst)
        req.blocks = {}

    # -- one decode step ---------------------------------------------------------------------
    def _layer_time(self, inst: _Instance) -> float:
        batch = len(inst.running)
        if self.policy == "single":
            tokens = sum(r.context for r in inst.running)
            tp = self.cluster.tensor_parallel or TensorParallelModel(num_kv_heads=1 << 30, hidden_size=0)
            return float(tp.layer_time(self.model, self.cluster.num_instances, batch, tokens))
        local_tokens = inst.hosted_blocks * self.B
        parts: dict[int, int] = {}
        for r in inst.running:
            remote_blocks = sum(n for idx, n in r.blocks.items() if idx != inst.idx)
            local_tokens += r.context - remote_blocks * self.B
            for idx, n in r.blocks.items():
                if idx != inst.idx:
                    parts[idx] = parts.get(idx, 0) + n * self.B
        largest = max(parts.values(), default=0)
        return float(instance_layer_time(self.model, batch, local_tokens, largest, bool(parts)))

    def _step(self, inst: _Instance) -> None:
        self._admit(inst)
        if not inst.running:
            inst.busy = False
            return
        duration = self._layer_time(inst) * self.model.num_layers
        end = self.now + duration
        still: list[_Req] = []
        for req in list(inst.running):
            if not req.admitted:  # preempted during this step
                continue
            req.generated += 1
            req.context += 1
            self.generated += 1
            if req.generated >= req.spec.output_tokens:
                self._release(req)
                self.finished.append((req, end))
                continue
            if req.context % self.B == 1 or self.B == 1:  # the new token opened a block
                if not self._grow(inst, req):
                    continue
            still.append(req)
        inst.running = [r for r in still if r.admitted]
        self._push(end, self._STEP, inst.idx)

    def _grow(self, inst: _Instance, req: _Req) -> bool:
        """Give ``req`` one more block at home; False if it was preempted instead."""
        if inst.free == 0 and self.policy == "infinite":
            target = max((i for i in self.instances if i is not inst), key=lambda i: (i.free, -i.idx), default=None)
            if target is not None and target.free > 0 and req.blocks.get(inst.idx, 0) > 1:
                self._move(req, inst.idx, target.idx, 1)
        if inst.free == 0:
            victim = inst.running[-1] if inst.running[-1].admitted else req
            for candidate in reversed(inst.running):
                if candidate.admitted:
                    victim = candidate
                    break
            self._preempt(inst, victim)
            if victim is req:
                return False
        self._take(inst.idx, 1, hosted=False)
        req.blocks[inst.idx] = req.blocks.get(inst.idx, 0) + 1
        return True

    def _preempt(self, inst: _Instance, victim: _Req) -> None:
        self.preemptions += 1
        self._release(victim)
        victim.admitted = False
        inst.queue.appendleft(victim)

    def _move(self, req: _Req, src: int, dst: int, n: int) -> None:
        req.blocks[src] -= n
        self.instances[src].free += n
        self._take(dst, n, hosted=True)
        req.blocks[dst] = req.blocks.get(dst, 0) + n
        self.num_moves += 1
        self.blocks_moved += n

    # -- the gManager ------------------------------------------------------------------------
    def snapshot(self) -> tuple[ClusterSnapshot, dict[int, _Req]]:
        """The cluster as the gManager would see it from heartbeats."""
        instances = []
        req_ids, inst_ids, blocks, local = [], [], [], []
        by_id: dict[int, _Req] = {}
        for inst in self.instances:
            waiting = sum(self._blocks(r.spec.prompt_tokens + r.generated + 1) for r in inst.queue)
            instances.append(InstanceState(inst.idx, inst.total, inst.free, len(inst.queue), waiting))
            for req in inst.running:
                by_id[req.spec.req_id] = req
                for idx, n in req.blocks.items():
                    req_ids.append(req.spec.req_id)
                    inst_ids.append(idx)
                    blocks.append(n)
                    local.append(idx == req.home)
        return ClusterSnapshot(self.B, tuple(instances), PlacementTable(req_ids, inst_ids, blocks, local)), by_id

    def _plan(self) -> None:
        snapshot, by_id = self.snapshot()
        for move in plan(snapshot, self.model, self.cluster.thresholds):
            self._move(by_id[move.req_id], move.src_inst, move.dst_inst, move.num_blocks)
        for inst in self.instances:
            self._wake(inst)

    def _result(self) -> SimResult:
        latencies = np.array([end - r.spec.arrival_s for r, end in self.finished])
        per_token = np.array([(end - r.spec.arrival_s) / r.spec.output_tokens for r, end in self.finished])
        start = self.trace[0].arrival_s if self.trace else 0.0
        makespan = max((end for _, end in self.finished), default=start) - start
        return SimResult(
            policy=self.policy,
            num_requests=len(self.trace),
            num_finished=len(self.finished),
            num_rejected=self.rejected,
            generated_tokens=self.generated,
            makespan_s=makespan,
            throughput_tokens_per_s=self.generated / makespan if makespan > 0 else 0.0,
            mean_latency_s=float(latencies.mean()) if len(latencies) else math.nan,
            p99_latency_s=float(np.percentile(latencies, 99)) if len(latencies) else math.nan,
            mean_per_token_latency_s=float(per_token.mean()) if len(per_token) else math.nan,
            num_moves=self.num_moves,
            blocks_moved=self.blocks_moved,
            num_preemptions=self.preemptions,
            peak_used_fraction=self.peak_used,
        )


def simulate(trace: Sequence[Request], model: PerfModel, cluster: ClusterConfig, policy: Policy) -> SimResult:
    """Run ``trace`` on ``cluster`` under ``policy``; see the module docstring."""
    return Simulation(trace, model, cluster, policy).run()


# -- traces ----------------------------------------------------------------------------------
def make_trace(
    kind: Literal["short", "long"],
    num_requests: int,
    rate_per_s: float,
    seed: int = 0,
    max_long_tokens: int = 2_000_000,
    long_fraction: float = 0.02,
) -> list[Request]:
    """A trace of mixed lengths, Poisson arrivals at ``rate_per_s``.

    ``"short"``: prompts log-uniform over 256-32K tokens (most short, a tail of long ones),
    outputs uniform 64-512. ``"long"``: the same plus ``long_fraction`` of prompts log-uniform
    over 100K-``max_long_tokens``.
    """
    if kind not in ("short", "long"):
        raise ValueError(f"kind must be 'short' or 'long', got {kind!r}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_s, num_requests))
    prompts = np.exp(rng.uniform(math.log(256), math.log(32_768), num_requests))
    if kind == "long":
        is_long = rng.random(num_requests) < long_fraction
        long_prompts = np.exp(rng.uniform(math.log(100_000), math.log(max_long_tokens), num_requests))
        prompts = np.where(is_long, long_prompts, prompts)
    outputs = rng.integers(64, 513, num_requests)
    return [Request(i, float(a), int(p), int(o)) for i, (a, p, o) in enumerate(zip(arrivals, prompts, outputs))]


def gpu_roofline_model(
    num_layers: int = 32,
    hidden_size: int = 4096,
    intermediate_size: int = 14336,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    num_heads: int = 32,
    hbm_bytes_per_s: float = 2.0e12,
    flops_per_s: float = 312e12,
    efficiency: float = 0.7,
    remote_overhead_s: float = 20e-6,
) -> PerfModel:
    """A :class:`PerfModel` from first principles for a GPU (default: Llama-3-8B on an A100).

    Dense: weights read once per step (``a``) until the matmuls turn compute-bound at the
    knee, then 2 FLOPs per weight per request (``c``). Attention: K and V of one layer read
    once per token. Both at ``efficiency`` of the datasheet figures.
    """
    weights = hidden_size * (num_heads + 2 * num_kv_heads) * head_dim + num_heads * head_dim * hidden_size
    weights += 3 * hidden_size * intermediate_size
    weight_read_s = weights * 2 / (hbm_bytes_per_s * efficiency)
    flops_per_seq_s = 2 * weights / (flops_per_s * efficiency)
    kv_bytes = 2 * num_kv_heads * head_dim * 2
    return PerfModel(
        num_layers=num_layers,
        dense_fixed_s=weight_read_s,
        dense_per_seq_s=0.0,
        attn_s_per_token=kv_bytes / (hbm_bytes_per_s * efficiency),
        dense_knee_batch=weight_read_s / flops_per_seq_s,
        dense_per_seq_above_knee_s=flops_per_seq_s,
        remote_overhead_s=remote_overhead_s,
        kv_bytes_per_token=kv_bytes * num_layers,
    )


def synthetic_snapshot(
    num_instances: int, num_requests: int, *, block_size: int = 16, blocks_per_instance: int = 30_000,
    long_instance_fraction: float = 0.05, seed: int = 0,
) -> ClusterSnapshot:
    """A cluster mid-way through a long-context trace, for timing the policy.

    A ``long_instance_fraction`` of the instances hold a few long requests that fill their
    memory and have a queue (the debtors); the others share the remaining requests, short
    ones, and are 40-85% full.
    """
    rng = np.random.default_rng(seed)
    num_long_inst = max(1, int(num_instances * long_instance_fraction))
    long_inst = rng.choice(num_instances, num_long_inst, replace=False)
    is_long = np.zeros(num_instances, bool)
    is_long[long_inst] = True
    num_long_reqs = 4 * num_long_inst
    short_home = rng.choice(np.flatnonzero(~is_long), num_requests - num_long_reqs)
    homes = np.concatenate([np.repeat(long_inst, 4), short_home])
    used_target = np.where(is_long, 0.98, rng.uniform(0.2, 0.85, num_instances)) * blocks_per_instance
    counts = np.bincount(homes, minlength=num_instances)
    per_req = np.floor(used_target[homes] / counts[homes] * rng.uniform(0.5, 1.5, len(homes))).astype(np.int64)
    per_req = np.maximum(per_req, 2)
    used = np.bincount(homes, weights=per_req, minlength=num_instances).astype(np.int64)
    scale = np.minimum(1.0, blocks_per_instance / np.maximum(used, 1))
    per_req = np.maximum((per_req * scale[homes]).astype(np.int64), 2)
    used = np.bincount(homes, weights=per_req, minlength=num_instances).astype(np.int64)
    instances = []
    for i in range(num_instances):
        # The debtors' queues hold short requests (64 blocks, 1K tokens, each) that their
        # memory cannot admit.
        waiting = 32 if is_long[i] else 0
        instances.append(InstanceState(i, blocks_per_instance, int(blocks_per_instance - used[i]), waiting, waiting * 64))
    table = PlacementTable(np.arange(len(homes)), homes, per_req, np.ones(len(homes), bool))
    return ClusterSnapshot(block_size, tuple(instances), table)
