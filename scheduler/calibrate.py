"""Calibrate the performance model: time decode steps at a grid of batch sizes and contexts.

Usage::

    python -m infinite_llm.scheduler.calibrate --out bench/results/perf_model-cpu.json
    python -m infinite_llm.scheduler.calibrate --device cuda --shape llama3-8b --out ...

Steps are measured through one function, ``measure_step(batch, context) -> seconds``, so that
the engine's own step can replace the probe used here. :class:`KernelLayerProbe` times one
Llama-family decoder layer built from this project's kernels (``write_kv`` +
``micro_attention`` over a paged pool) and torch matmuls (q/k/v/o projections, SwiGLU MLP,
RMSNorm), and multiplies by the number of layers: every layer of a decoder does the same work,
and one layer's weights and pool keep the CPU calibration within memory.

Each point keeps its fastest sample over interleaved sweeps of the grid; on the CPU, sweeps go
on over the points whose two fastest samples still disagree (:func:`sample_grid`), because a
small shared machine's timings vary by tens of percent.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from infinite_llm.kernels import (
    KVPoolShape,
    allocate_kv_pool,
    merge_attention_states,
    plan_micro_attention,
    run_micro_attention,
    write_kv,
)

from .perf_model import Measurement, fit, save_model

MeasureStep = Callable[[int, int], float]
_MALLOC_ENV_PAIRS = (("MALLOC_MMAP_THRESHOLD_", str(1 << 32)), ("MALLOC_TRIM_THRESHOLD_", str(1 << 34)))
_MALLOC_ENV = tuple(name for name, _ in _MALLOC_ENV_PAIRS)


@dataclass(frozen=True)
class LayerShape:
    """Shapes of a Llama-family decoder layer."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V bytes of one token over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * itemsize


SHAPES = {
    "smollm2-135m": LayerShape("smollm2-135m", 30, 576, 9, 3, 64, 1536),
    "llama3-8b": LayerShape("llama3-8b", 32, 4096, 32, 8, 128, 14336),
}
# 60 points on the CPU: a quarter held out is 15 points, enough for the held-out error to mean
# something (with 6 held-out points one noisy sample moves it by several percent).
CPU_BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
CPU_CONTEXTS = (256, 512, 1024, 2048, 3072, 4096)
CUDA_BATCHES = (1, 4, 16, 32, 64, 128, 256)
CUDA_CONTEXTS = (1024, 4096, 16384, 32768)


class KernelLayerProbe:
    """Times one decode step of a decoder built from the project's kernels.

    Weights and the KV pool are random; the pool holds one layer and is sized for the largest
    ``batch * context`` asked for, blocks of each request laid out contiguously after a
    random permutation (a pool that has seen traffic is not in order).
    """

    def __init__(
        self,
        shape: LayerShape,
        device: torch.device,
        dtype: torch.dtype,
        max_tokens: int,
        block_size: int = 16,
        repeats: int = 7,
        seed: int = 0,
    ) -> None:
        self.shape, self.device, self.dtype = shape, device, dtype
        self.block_size, self.repeats = block_size, repeats
        generator = torch.Generator(device="cpu").manual_seed(seed)

        def weight(rows: int, cols: int) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=generator) / math.sqrt(cols)
            return w.to(device=device, dtype=dtype)

        h, d = shape.hidden_size, shape.head_dim
        self.w_qkv = weight((shape.num_heads + 2 * shape.num_kv_heads) * d, h)
        self.w_o = weight(h, shape.num_heads * d)
        self.w_gate_up = weight(2 * shape.intermediate_size, h)
        self.w_down = weight(h, shape.intermediate_size)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        num_blocks = max_tokens // block_size + 2 * 256
        self.pool_shape = KVPoolShape(num_blocks, 1, block_size, shape.num_kv_heads, d)
        self.kv_pool = allocate_kv_pool(self.pool_shape, dtype, device)
        self.kv_pool.normal_(generator=None)
        self.block_order = torch.randperm(num_blocks, generator=generator).to(torch.int32)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _layer(self, x: torch.Tensor, plan, slot_mapping: torch.Tensor) -> torch.Tensor:
        s = self.shape
        # x: [batch, hidden]
        residual = x
        x = F.rms_norm(x, (s.hidden_size,), self.norm)
        qkv = x @ self.w_qkv.T
        q, k, v = qkv.split([s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], -1)
        q = q.reshape(-1, s.num_heads, s.head_dim)
        write_kv(
            k.reshape(-1, s.num_kv_heads, s.head_dim), v.reshape(-1, s.num_kv_heads, s.head_dim),
            self.kv_pool, 0, slot_mapping, check_bounds=False,
        )
        attn = run_micro_attention(plan, q.contiguous(), self.kv_pool, 0, out_dtype=self.dtype, return_lse=False)
        x = residual + attn.out.reshape(-1, s.num_heads * s.head_dim) @ self.w_o.T
        residual = x
        x = F.rms_norm(x, (s.hidden_size,), self.norm)
        gate, up = (x @ self.w_gate_up.T).chunk(2, dim=-1)
        return residual + (F.silu(gate) * up) @ self.w_down.T

    def measure_step(self, batch: int, context: int) -> float:
        """Median seconds of one decode step (all layers) of ``batch`` requests of ``context`` tokens."""
        blocks_per_seq = -(-(context + 1) // self.block_size)
        if batch * blocks_per_seq > self.pool_shape.num_blocks:
            raise ValueError(f"{batch} x {context} tokens do not fit the probe's pool")
        ids = self.block_order[: batch * blocks_per_seq].reshape(batch, blocks_per_seq)
        block_tables = ids.to(self.device)
        kv_lens = torch.full((batch,), context + 1, dtype=torch.int32, device=self.device)
        query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=self.device)
        # The new token's K and V land in the slot after the context, as in the engine.
        slot_mapping = (ids[:, context // self.block_size] * self.block_size + context % self.block_size).to(
            device=self.device, dtype=torch.int64
        )
        s = self.shape
        plan = plan_micro_attention(
            block_tables, kv_lens, query_start_loc, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
            head_dim=s.head_dim, block_size=self.block_size, num_blocks=self.pool_shape.num_blocks,
            max_query_len=1, max_kv_len=context + 1,
        )
        x = torch.randn(batch, s.hidden_size, device=self.device, dtype=self.dtype)
        times = []
        with torch.inference_mode():
            for repeat in range(self.repeats + 1):
                self._sync()
                start = time.perf_counter()
                self._layer(x, plan, slot_mapping)
                self._sync()
                if repeat:  # the first run warms caches and the allocator
                    times.append(time.perf_counter() - start)
        # The minimum, not the median: on a shared machine other processes only ever add
        # time, so the fastest of the repeats is the closest to the step's own cost.
        return min(times) * s.num_layers

    def measure_remote_overhead(self, batch: int = 8, num_parts: int = 2) -> float:
        """Per-layer seconds to merge ``num_parts`` partial states of ``batch`` query rows.

        This is the compute side of a remote part; the network round trip is added by the
        caller (``--remote-latency-us``) since one process has no network to time.
        """
        s = self.shape
        outs = torch.randn(num_parts, batch, s.num_heads, s.head_dim, device=self.device)
        lses = torch.randn(num_parts, batch, s.num_heads, device=self.device)
        times = []
        for repeat in range(self.repeats + 1):
            self._sync()
            start = time.perf_counter()
            merge_attention_states(outs, lses)
            self._sync()
            if repeat:
                times.append(time.perf_counter() - start)
        return statistics.median(times)


@dataclass(frozen=True)
class GridSamples:
    """Every sample of a grid sweep: ``samples[(batch, context)]`` lists step seconds."""

    samples: dict[tuple[int, int], list[float]]
    num_rounds: int  # sweeps of the whole grid, settling sweeps included

    def best(self) -> list[Measurement]:
        """Each point's fastest sample, in grid order."""
        return [Measurement(b, c, min(v)) for (b, c), v in self.samples.items()]

    def spread_pct(self, point: tuple[int, int]) -> float:
        """How far a point's second-fastest sample is above its fastest, in %."""
        fastest, second = sorted(self.samples[point])[:2]
        return (second / fastest - 1.0) * 100.0

    def noise_pct(self) -> float:
        """Median over points of (median sample / fastest sample - 1), in %: how much the
        machine's other load slowed a typical sample."""
        return statistics.median((statistics.median(v) / min(v) - 1.0) * 100.0 for v in self.samples.values())


def sample_grid(
    measure_step: MeasureStep,
    batches: Sequence[int],
    contexts: Sequence[int],
    rounds: int = 3,
    seed: int = 0,
    settle_pct: float | None = None,
    max_rounds: int | None = None,
) -> GridSamples:
    """Sample every (batch, context) of the grid through ``measure_step``.

    The grid is swept ``rounds`` times in a fresh random order each time, so that a burst of
    load from another process spoils one sample of a point, not a run of neighbouring points.
    With ``settle_pct``, further sweeps (up to ``max_rounds`` in all) re-measure only the
    points whose two fastest samples still differ by more than ``settle_pct`` percent: other
    processes only ever add time, so two fast samples that agree are the point's own cost,
    and a lone fast sample is not yet trusted.
    """
    grid = [(b, c) for b in batches for c in contexts]
    if rounds < 1 or (settle_pct is not None and rounds < 2):
        raise ValueError(f"need at least 1 round (2 to settle points), got {rounds}")
    samples: dict[tuple[int, int], list[float]] = {point: [] for point in grid}
    generator = torch.Generator().manual_seed(seed)
    limit = max(rounds, max_rounds or rounds) if settle_pct is not None else rounds
    pending = list(grid)
    num_rounds = 0
    while pending and num_rounds < limit:
        for index in torch.randperm(len(pending), generator=generator).tolist():
            samples[pending[index]].append(measure_step(*pending[index]))
        num_rounds += 1
        if num_rounds >= rounds:
            if settle_pct is None:
                break
            result = GridSamples(samples, num_rounds)
            pending = [point for point in grid if result.spread_pct(point) > settle_pct]
    return GridSamples(samples, num_rounds)


def measure_grid(
    measure_step: MeasureStep,
    batches: Sequence[int],
    contexts: Sequence[int],
    rounds: int = 3,
    seed: int = 0,
) -> list[Measurement]:
    """Each grid point's fastest of ``rounds`` interleaved sweeps (see :func:`sample_grid`)."""
    return sample_grid(measure_step, batches, contexts, rounds=rounds, seed=seed).best()


def holdout_spread(measurements: Sequence[Measurement], num_layers: int, num_splits: int = 20) -> dict[str, float]:
    """Held-out MAPE (%) over ``num_splits`` random train/held-out splits: min, median, max.

    One split's figure depends on which points it happened to hold out; the spread over
    splits says how much. Splits whose training points admit no fit (see :func:`fit`) are
    counted in ``num_failed`` and left out.
    """
    errors, failed = [], 0
    for seed in range(num_splits):
        try:
            errors.append(fit(measurements, num_layers, seed=seed)[1].holdout_mape_pct)
        except ValueError:
            failed += 1
    if not errors:
        return {"num_splits": num_splits, "num_failed": failed, "min": math.nan, "median": math.nan, "max": math.nan}
    errors.sort()
    return {"num_splits": num_splits, "num_failed": failed, "min": errors[0], "median": statistics.median(errors), "max": errors[-1]}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--shape", default=None, choices=sorted(SHAPES), help="default: smollm2-135m on the CPU, llama3-8b on CUDA")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--contexts", default=None, help="comma-separated context lengths (tokens)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point and round")
    parser.add_argument("--rounds", type=int, default=None, help="sweeps of the grid (each point keeps its best); default 6 on the CPU, 3 on CUDA")
    parser.add_argument("--settle-pct", type=float, default=None,
                        help="re-measure points whose two fastest samples differ by more than this (%%); default 2 on the CPU, off on CUDA")
    parser.add_argument("--max-rounds", type=int, default=30, help="most sweeps in all when settling")
    parser.add_argument("--remote-latency-us", type=float, default=0.0, help="network round trip per layer added to the merge time")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default 1 on the CPU)")
    parser.add_argument("--out", default="bench/results/perf_model-cpu.json")
    parser.add_argument("--keep-malloc", action="store_true", help="do not re-run with glibc's mmap threshold raised")
    args = parser.parse_args(argv)
    if args.device == "cpu" and not args.keep_malloc and _MALLOC_ENV[0] not in os.environ and argv is None:
        # glibc hands every freed buffer above its mmap threshold back to the OS, so the CPU
        # attention path faults its gathered KV copies in again at every step: a cost that
        # grows with the context and belongs to the allocator, not to the model. A serving
        # process keeps its heap; so does this one, by re-running itself with the threshold up.
        os.execve(sys.executable, [sys.executable, "-m", "infinite_llm.scheduler.calibrate", *sys.argv[1:]],
                  {**os.environ, **dict(_MALLOC_ENV_PAIRS)})

    device = torch.device(args.device)
    on_cuda = device.type == "cuda"
    shape = SHAPES[args.shape or ("llama3-8b" if on_cuda else "smollm2-135m")]
    dtype = torch.bfloat16 if on_cuda else torch.float32
    if args.threads:
        torch.set_num_threads(args.threads)
    elif not on_cuda:
        # One thread: timings on a small shared machine vary far less than with a pool.
        torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")] if args.batches else list(CUDA_BATCHES if on_cuda else CPU_BATCHES)
    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else list(CUDA_CONTEXTS if on_cuda else CPU_CONTEXTS)

    probe = KernelLayerProbe(shape, device, dtype, max_tokens=max(batches) * (max(contexts) + 16), repeats=args.repeats)
    rounds = args.rounds or (3 if on_cuda else 6)
    # A GPU's timings barely vary; a small shared CPU's vary by tens of percent.
    settle_pct = args.settle_pct if args.settle_pct is not None else (None if on_cuda else 2.0)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    grid = sample_grid(probe.measure_step, batches, contexts, rounds=rounds, settle_pct=settle_pct, max_rounds=args.max_rounds)
    measurements = grid.best()
    load_after = os.getloadavg()[0]
    remote_overhead_s = probe.measure_remote_overhead() + args.remote_latency_us * 1e-6
    model, report = fit(
        measurements, shape.num_layers, remote_overhead_s=remote_overhead_s,
        kv_bytes_per_token=shape.kv_bytes_per_token(dtype),
    )
    splits = holdout_spread(measurements, shape.num_layers)
    unsettled = [point for point in grid.samples if grid.spread_pct(point) > (settle_pct or math.inf)]
    save_model(
        args.out, model, report,
        device=torch.cuda.get_device_name(device) if on_cuda else platform.processor() or platform.machine(),
        torch_version=torch.__version__,
        torch_threads=torch.get_num_threads(),
        malloc_env={name: os.environ.get(name) for name in _MALLOC_ENV},
        dtype=str(dtype).removeprefix("torch."),
        shape=asdict(shape),
        measurements=[asdict(m) for m in measurements],
        calibration_s=round(time.perf_counter() - started, 1),
        sampling={
            "repeats_per_sample": args.repeats, "rounds": grid.num_rounds, "min_rounds": rounds,
            "settle_pct": settle_pct, "num_samples": sum(len(v) for v in grid.samples.values()),
            "unsettled_points": [list(point) for point in unsettled],
            "noise_pct": grid.noise_pct(), "load_average_1min": [load_before, load_after],
            "num_cpus": os.cpu_count(),
        },
        holdout_mape_over_splits=splits,
    )
    print(f"{shape.name} on {device}: {len(measurements)} points in {time.perf_counter() - started:.0f} s")
    print(
        f"dense a={model.dense_fixed_s * 1e6:.1f} us b={model.dense_per_seq_s * 1e6:.2f} us/seq "
        f"knee={model.dense_knee_batch} c={model.dense_per_seq_above_knee_s * 1e6:.2f} us/seq; "
        f"g={model.attention_tokens_per_s / 1e6:.2f} M tokens/s/layer (knee {model.attn_knee_tokens}, "
        f"+{model.attn_s_per_token_above_knee * 1e9:.1f} ns/token above); merge+remote={remote_overhead_s * 1e6:.1f} us"
    )
    print(f"{grid.num_rounds} sweeps, {len(unsettled)} points unsettled; a median sample was {grid.noise_pct():.0f}% above "
          f"its point's fastest; load average {load_before:.1f} -> {load_after:.1f} on {os.cpu_count()} CPUs")
    print(f"MAPE train {report.train_mape_pct:.2f}%  held-out {report.holdout_mape_pct:.2f}% (max {report.holdout_max_ape_pct:.2f}%; "
          f"over {splits['num_splits']} splits {splits['min']:.1f}-{splits['max']:.1f}%, median {splits['median']:.1f}%) -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
