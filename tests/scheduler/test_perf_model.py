"""The perf model: formulas, fit on synthetic data, JSON, and the calibration probe."""

import json

import numpy as np
import pytest
import torch

from infinite_llm.scheduler.calibrate import KernelLayerProbe, LayerShape, holdout_spread, measure_grid, sample_grid
from infinite_llm.scheduler.perf_model import (
    Measurement,
    PerfModel,
    TensorParallelModel,
    cluster_throughput,
    fit,
    load_model,
    save_model,
)

TRUE = PerfModel(
    num_layers=30, dense_fixed_s=4e-4, dense_per_seq_s=6e-5, attn_s_per_token=8e-8,
    dense_knee_batch=8, dense_per_seq_above_knee_s=1e-4,
)
BATCHES = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (256, 1024, 4096, 8192)


def synthetic(model, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    points = []
    for b in BATCHES:
        for c in CONTEXTS:
            step = model.layer_time(b, [c] * b) * model.num_layers
            points.append(Measurement(b, c, step * (1 + noise * rng.standard_normal())))
    return points


def test_fit_recovers_known_parameters_from_exact_data():
    model, report = fit(synthetic(TRUE), TRUE.num_layers)
    assert model.dense_knee_batch == 8
    for name in ("dense_fixed_s", "dense_per_seq_s", "attn_s_per_token", "dense_per_seq_above_knee_s"):
        assert getattr(model, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert report.holdout_mape_pct < 1e-6 and report.num_holdout == 7 and report.num_train == 21


def test_fit_with_noise_stays_within_tolerance_and_reports_holdout_error():
    model, report = fit(synthetic(TRUE, noise=0.03, seed=1), TRUE.num_layers)
    assert model.attn_s_per_token == pytest.approx(TRUE.attn_s_per_token, rel=0.15)
    assert model.dense_time(32) == pytest.approx(TRUE.dense_time(32), rel=0.15)
    assert 0.5 < report.holdout_mape_pct < 8
    assert len(report.holdout_points) == report.num_holdout


def test_fit_finds_a_drop_of_attention_throughput_past_a_cache():
    cached = PerfModel(30, 3e-4, 5e-5, 2e-8, attn_knee_tokens=32768, attn_s_per_token_above_knee=6e-8)
    model, report = fit(synthetic(cached), 30)
    assert model.attn_knee_tokens == 32768
    assert model.attn_s_per_token_above_knee == pytest.approx(6e-8, rel=1e-6)
    assert report.holdout_mape_pct < 1e-6


def test_fit_rejects_bad_input():
    with pytest.raises(ValueError, match="at least 6"):
        fit(synthetic(TRUE)[:3], 30)
    with pytest.raises(ValueError, match="bad measurement"):
        fit(synthetic(TRUE)[:7] + [Measurement(0, 10, 1.0)], 30)
    with pytest.raises(ValueError, match="3 distinct batch sizes"):
        fit([Measurement(1, c, 1e-3 * (1 + c)) for c in range(8)], 30)


def test_debtor_and_creditor_times():
    m = PerfModel(num_layers=2, dense_fixed_s=1e-3, dense_per_seq_s=1e-4, attn_s_per_token=1e-6, remote_overhead_s=5e-5)
    assert m.layer_time(2, [100, 300]) == pytest.approx(1.2e-3 + 400e-6)
    assert m.creditor_layer_time(2, [100, 300], hosted_tokens=600) == pytest.approx(1.2e-3 + 1000e-6)
    # The debtor waits for its slowest creditor when that part outweighs its local work.
    assert m.debtor_layer_time(2, 200, [50, 500]) == pytest.approx(1.2e-3 + 500e-6 + 5e-5)
    assert m.debtor_layer_time(2, 800, [50, 500]) == pytest.approx(1.2e-3 + 800e-6 + 5e-5)
    assert m.debtor_layer_time(2, 800, []) == pytest.approx(1.2e-3 + 800e-6)
    assert float(m.throughput(2, 1e-3)) == pytest.approx(1000.0)
    assert cluster_throughput(m, [2, 0], [1e-3, 1e-3]) == pytest.approx(1000.0)
    with pytest.raises(ValueError, match="batch is 3"):
        m.layer_time(3, [1, 2])
    with pytest.raises(ValueError, match=">= 0"):
        m.debtor_layer_time(1, 10, [-1])
    with pytest.raises(ValueError, match="num_layers"):
        PerfModel(0, 1e-3, 0, 0)


def test_tensor_parallel_attention_stops_scaling_at_the_kv_heads():
    m = PerfModel(num_layers=1, dense_fixed_s=0.0, dense_per_seq_s=1e-3, attn_s_per_token=1e-6)
    tp = TensorParallelModel(num_kv_heads=8, hidden_size=1, allreduce_latency_s=0.0, link_bytes_per_s=1e30)
    assert float(tp.layer_time(m, 32, 32, 1000)) == pytest.approx(32e-3 / 32 + 1e-3 / 8)
    assert tp.kv_replication(32) == 4 and tp.kv_replication(4) == 1


def test_save_and_load_round_trip(tmp_path):
    model, report = fit(synthetic(TRUE), 30)
    path = tmp_path / "model.json"
    save_model(path, model, report, device="test")
    assert load_model(path) == model
    document = json.loads(path.read_text())
    assert document["fit_report"]["num_holdout"] == 7 and document["device"] == "test"
    document["format_version"] = 99
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="format_version"):
        load_model(path)


def test_kernel_probe_measures_a_tiny_layer_and_feeds_the_fit():
    shape = LayerShape("tiny", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128)
    probe = KernelLayerProbe(shape, torch.device("cpu"), torch.float32, max_tokens=8 * 2100, repeats=2)
    # Contexts far apart and three sweeps: on a busy machine a single sweep of a tiny layer can
    # bury the attention term in noise.
    points = measure_grid(probe.measure_step, (1, 2, 4, 8), (32, 2048), rounds=3)
    assert len(points) == 8 and all(p.step_s > 0 for p in points)
    model, report = fit(points, shape.num_layers)
    assert model.num_layers == 2 and np.isfinite(report.holdout_mape_pct)
    assert probe.measure_remote_overhead(batch=2) > 0
    with pytest.raises(ValueError, match="do not fit"):
        probe.measure_step(64, 4096)


def test_tensor_parallel_keeps_the_unsplit_dense_time_and_takes_a_tree_all_reduce():
    m = PerfModel(num_layers=1, dense_fixed_s=300e-6, dense_per_seq_s=0.0, attn_s_per_token=0.0)
    tp = TensorParallelModel(num_kv_heads=8, hidden_size=1, allreduce_latency_s=1e-6, link_bytes_per_s=1e30, unsplit_dense_s=200e-6)
    # 200 us on every GPU, the other 100 us split 4 ways; a tree of 2 * log2(4) = 4 steps per all-reduce.
    assert float(tp.dense_time(m, 4, 1)) == pytest.approx(200e-6 + 25e-6 + 2 * 4e-6)
    # 32 GPUs: 10 tree steps rather than a ring's 62.
    assert float(tp.allreduce_time(32, 1)) == pytest.approx(10e-6)
    assert float(tp.allreduce_time(2, 1)) == pytest.approx(2e-6)
    assert float(tp.dense_time(m, 1, 1)) == pytest.approx(300e-6)
    with pytest.raises(ValueError, match="degree"):
        tp.dense_time(m, 0, 1)


def test_fit_finds_the_cheaper_single_sequence_path_as_a_dense_knee():
    # The CPU runs one sequence through a fused kernel and a batch through one padded matmul
    # that costs more per step: the step from batch 1 to 2 is steeper than the rest.
    base = PerfModel(30, 2e-4, 5e-5, 1e-7, dense_knee_batch=2, dense_per_seq_above_knee_s=-4e-5)
    model, report = fit(synthetic(base), 30)
    assert model.dense_knee_batch == 2 and report.holdout_mape_pct < 1e-6


def fake_step(noisy_first: dict, calls: list):
    """A step whose time is batch * context ns; the first samples of some points are slowed."""

    def measure(batch, context):
        calls.append((batch, context))
        seen = calls.count((batch, context))
        slow = noisy_first.get((batch, context), 0)
        return batch * context * 1e-9 * (1.5 + 0.1 * seen if seen <= slow else 1.0)

    return measure


def test_sample_grid_resamples_only_unsettled_points_and_keeps_the_fastest():
    calls = []
    # (2, 64): its first three samples are slow; every other point is exact from the start.
    grid = sample_grid(fake_step({(2, 64): 3}, calls), (1, 2), (32, 64), rounds=2, settle_pct=1.0, max_rounds=10)
    assert calls.count((2, 64)) == 5 and calls.count((1, 32)) == 2
    assert grid.num_rounds == 5
    assert {(m.batch, m.context): m.step_s for m in grid.best()}[(2, 64)] == pytest.approx(128e-9)
    assert grid.spread_pct((2, 64)) == pytest.approx(0.0)
    # Without settling, a fixed number of sweeps whatever the spread.
    calls.clear()
    grid = sample_grid(fake_step({(2, 64): 3}, calls), (1, 2), (32, 64), rounds=2)
    assert grid.num_rounds == 2 and len(calls) == 8 and grid.spread_pct((2, 64)) > 1.0
    # A point that never settles stops at max_rounds.
    calls.clear()
    grid = sample_grid(fake_step({(1, 32): 100}, calls), (1, 2), (32, 64), rounds=2, settle_pct=1.0, max_rounds=4)
    assert grid.num_rounds == 4 and calls.count((1, 32)) == 4 and grid.noise_pct() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="round"):
        sample_grid(fake_step({}, []), (1,), (1,), rounds=1, settle_pct=1.0)


def test_holdout_spread_over_random_splits():
    spread = holdout_spread(synthetic(TRUE, noise=0.03, seed=2), 30, num_splits=5)
    assert spread["num_splits"] == 5 and spread["num_failed"] == 0
    assert 0 < spread["min"] <= spread["median"] <= spread["max"] < 10


def test_a_model_whose_dense_time_falls_with_the_batch_or_is_none_at_one_request_is_refused():
    base = dict(num_layers=30, dense_fixed_s=4e-4, dense_per_seq_s=6e-5, attn_s_per_token=8e-8)
    with pytest.raises(ValueError, match="dense time per request must be >= 0"):
        PerfModel(**{**base, "dense_per_seq_s": -1e-6})
    with pytest.raises(ValueError, match="dense time per request must be >= 0"):
        PerfModel(**{**base, "dense_knee_batch": 8, "dense_per_seq_above_knee_s": -7e-5})
    with pytest.raises(ValueError, match="dense time at batch 1 must be positive"):
        PerfModel(**{**base, "dense_fixed_s": -1e-3})
    with pytest.raises(ValueError, match="positive and finite"):
        PerfModel(**{**base, "dense_knee_batch": float("nan")})
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        PerfModel(**{**base, "num_layers": 2.5})
    # A negative intercept is fine while a step of one request still takes time.
    assert float(PerfModel(**{**base, "dense_fixed_s": -1e-5}).dense_time(1)) == pytest.approx(5e-5)


def test_fit_skips_knees_that_make_a_larger_batch_cheaper():
    """Flat dense time with the top batch measured 3% fast (noise): the best knee by error alone
    makes dense time fall past it, and throughput grows faster than the batch beyond the grid."""
    layers = 32
    points = []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for c in (1024, 4096, 16384):
            layer_s = 358e-6 + 0.3e-6 * b + 1.4e-10 * b * c
            points.append(Measurement(b, c, layer_s * layers * (0.97 if b == 64 else 1.0)))
    model, _ = fit(points, layers)
    above = model.dense_per_seq_s + (model.dense_per_seq_above_knee_s if model.dense_knee_batch else 0.0)
    assert model.dense_per_seq_s >= 0 and above >= 0
    times = [float(model.dense_time(b)) for b in (64, 256, 1024, 4096)]
    assert times == sorted(times)
