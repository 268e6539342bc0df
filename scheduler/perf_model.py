"""Performance model of one decode step: the Infinite-LLM paper's per-layer time, fitted.

Per layer, one decode step of an instance running ``beta`` requests whose KV it holds takes

    T(beta, S) = W(beta) / f(beta) + sum_r S_r / g

* ``W(beta) / f(beta)`` is the non-attention ("dense") time: projections, MLP, norms, the
  per-request bookkeeping. Modelled as ``a + b * beta + c * max(0, beta - knee)``: a fixed
  cost (weights read once per step on a GPU, launch and interpreter overhead on the CPU), a
  per-request cost, and a second slope above a knee where the matmuls turn compute-bound.
* ``sum_r S_r / g(S)`` is the attention time: decode attention reads every key and value
  once, so it is linear in the tokens read, at ``g`` tokens/s (``attn_s_per_token = 1 / g``),
  with ``g`` dropping once the total ``S`` outgrows a cache (``attn_knee_tokens``; above it
  each token costs ``attn_s_per_token + attn_s_per_token_above_knee``). A fixed attention
  launch cost folds into ``a``.

DistAttention changes which tokens an instance reads:

* a *creditor* also reads the tokens it holds for other instances' requests
  (``hosted_tokens``), so its attention term is ``(local + hosted) / g``;
* a *debtor* sends the query of its requests with remote parts to each creditor, which
  attends over its part concurrently with the debtor's local attention; the debtor waits for
  the slowest part and merges: its attention term is
  ``max(local_and_hosted, largest_remote_part) / g + remote_overhead_s``. The largest remote
  part is the sum over the debtor's requests of the tokens held on one creditor (one
  ``AttendRequest`` per creditor and layer), maximised over creditors.

Instance throughput is ``beta / (num_layers * T)`` tokens/s, cluster throughput the sum.

Everything here is plain data and numpy: no I/O except :func:`save_model` / :func:`load_model`.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

FORMAT_VERSION = 1


@dataclass(frozen=True)
class PerfModel:
    """Fitted per-layer decode-step time of one instance. Times in seconds, per layer."""

    num_layers: int
    dense_fixed_s: float  # a: dense time of a step at batch 0 (extrapolated)
    dense_per_seq_s: float  # b: dense time added per request in the batch
    attn_s_per_token: float  # 1 / g: attention time per KV token read
    dense_knee_batch: float | None = None  # batch above which the slope changes; None: no knee
    dense_per_seq_above_knee_s: float = 0.0  # c: slope added above the knee
    attn_knee_tokens: float | None = None  # total tokens above which g drops; None: constant g
    attn_s_per_token_above_knee: float = 0.0  # added per token above the knee (may be < 0)
    remote_overhead_s: float = 0.0  # a debtor's per-layer cost of remote parts: query send, merge
    kv_bytes_per_token: int | None = None  # all layers, K and V; only to report g in bytes/s

    def __post_init__(self) -> None:
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers <= 0:
            raise ValueError(f"num_layers must be a positive integer, got {self.num_layers!r}")
        for name in ("attn_s_per_token", "remote_overhead_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"PerfModel.{name} must be finite and >= 0, got {value}")
        above = self.attn_s_per_token + self.attn_s_per_token_above_knee
        if not math.isfinite(above) or above < 0:
            raise ValueError(f"attention cost per token above the knee must be >= 0, got {above}")
        for name in ("dense_fixed_s", "dense_per_seq_s", "dense_per_seq_above_knee_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"PerfModel.{name} must be finite, got {getattr(self, name)}")
        for name in ("dense_knee_batch", "attn_knee_tokens"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"PerfModel.{name} must be positive and finite, or None, got {value}")
        # Dense time must not fall as the batch grows, nor be zero at one request: either would
        # make a larger batch, or a fraction of one, look faster than it is.
        above_knee = self.dense_per_seq_s + (self.dense_per_seq_above_knee_s if self.dense_knee_batch is not None else 0.0)
        if self.dense_per_seq_s < 0 or above_knee < 0:
            raise ValueError(f"dense time per request must be >= 0 below and above the knee, got "
                             f"{self.dense_per_seq_s} and {above_knee}")
        if self.dense_fixed_s + self.dense_per_seq_s <= 0:
            raise ValueError(f"dense time at batch 1 must be positive, got {self.dense_fixed_s + self.dense_per_seq_s}")

    # -- the pieces -------------------------------------------------------------------------
    def dense_time(self, batch):
        """Per-layer non-attention time (s) of a step at ``batch`` requests (scalar or array).

        Never below ``dense_fixed_s`` scaled to batch 1 would allow: a fit with a negative
        intercept is clamped at a small positive floor, so that times stay positive.
        """
        batch = np.asarray(batch, dtype=np.float64)
        time = self.dense_fixed_s + self.dense_per_seq_s * batch
        if self.dense_knee_batch is not None:
            time = time + self.dense_per_seq_above_knee_s * np.maximum(batch - self.dense_knee_batch, 0.0)
        return np.maximum(time, _MIN_LAYER_TIME_S)

    def attention_time(self, tokens):
        """Per-layer attention time (s) of reading ``tokens`` KV tokens (scalar or array)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        time = self.attn_s_per_token * tokens
        if self.attn_knee_tokens is not None:
            time = time + self.attn_s_per_token_above_knee * np.maximum(tokens - self.attn_knee_tokens, 0.0)
        return time

    @property
    def attention_tokens_per_s(self) -> float:
        """g below the knee, in KV tokens read per second per layer."""
        return math.inf if self.attn_s_per_token == 0 else 1.0 / self.attn_s_per_token

    @property
    def attention_bytes_per_s(self) -> float | None:
        """g in bytes/s (one layer's K and V bytes per token / attn_s_per_token)."""
        if self.kv_bytes_per_token is None:
            return None
        return self.attention_tokens_per_s * self.kv_bytes_per_token / self.num_layers

    # -- the paper's formulas ---------------------------------------------------------------
    def layer_time(self, batch: int, contexts: Sequence[int]) -> float:
        """T(beta, S) of an instance holding all KV of its ``batch`` requests (s per layer).

        Args:
            batch: requests in the step.
            contexts: KV tokens of each request (``len(contexts) == batch``).
        """
        if len(contexts) != batch:
            raise ValueError(f"batch is {batch} but {len(contexts)} contexts were given")
        return float(self.dense_time(batch) + self.attention_time(float(sum(contexts))))

    def creditor_layer_time(self, batch: int, contexts: Sequence[int], hosted_tokens: int) -> float:
        """Per-layer time (s) of an instance that also attends over ``hosted_tokens`` of others."""
        if hosted_tokens < 0:
            raise ValueError(f"hosted_tokens must be >= 0, got {hosted_tokens}")
        return self.layer_time(batch, contexts) + float(self.attention_time(hosted_tokens))

    def debtor_layer_time(
        self, batch: int, local_tokens: int, remote_part_tokens: Sequence[int], hosted_tokens: int = 0
    ) -> float:
        """Per-layer time (s) of a debtor.

        Args:
            batch: requests in the step.
            local_tokens: KV tokens of its own requests held locally.
            remote_part_tokens: per creditor, the tokens of its requests held there.
            hosted_tokens: tokens it holds for others (a debtor may also be a creditor).
        """
        parts = [int(p) for p in remote_part_tokens]
        if local_tokens < 0 or hosted_tokens < 0 or any(p < 0 for p in parts):
            raise ValueError("token counts must be >= 0")
        return float(
            instance_layer_time(
                self, batch, local_tokens + hosted_tokens, max(parts, default=0), bool(parts)
            )
        )

    def throughput(self, batch, layer_time_s):
        """Decode tokens/s of an instance: ``batch / (num_layers * T)`` (scalar or array)."""
        batch = np.asarray(batch, dtype=np.float64)
        return batch / (self.num_layers * np.asarray(layer_time_s, dtype=np.float64))


# A floor on per-layer times so that a fitted model never predicts zero or negative time.
_MIN_LAYER_TIME_S = 1e-9


def instance_layer_time(model: PerfModel, batch, local_tokens, largest_remote_part_tokens, has_remote):
    """Per-layer step time (s) of instances in any role (numpy-vectorised over instances).

    Args:
        batch: requests whose step the instance runs.
        local_tokens: tokens it reads itself: its own requests' local KV plus KV it hosts.
        largest_remote_part_tokens: tokens of its requests on its most loaded creditor (0: none).
        has_remote: whether any of its requests has a remote part (pays ``remote_overhead_s``).
    """
    attention_tokens = np.maximum(local_tokens, largest_remote_part_tokens)
    return (
        model.dense_time(batch)
        + model.attention_time(attention_tokens)
        + model.remote_overhead_s * np.asarray(has_remote, dtype=np.float64)
    )


def cluster_throughput(model: PerfModel, batch, layer_time_s) -> float:
    """Sum of instance throughputs (tokens/s); instances with batch 0 contribute 0."""
    batch = np.asarray(batch, dtype=np.float64)
    per_instance = np.where(batch > 0, batch / (model.num_layers * np.asarray(layer_time_s)), 0.0)
    return float(per_instance.sum())


@dataclass(frozen=True)
class TensorParallelModel:
    """One instance spread over ``degree`` GPUs by tensor parallelism (the vLLM baselines).

    Dense layers split their matmuls ``degree`` ways, except ``unsplit_dense_s`` per layer that
    every GPU pays whatever the degree (kernel launches and the host's work per layer: on an
    eager engine most of a small batch's dense time), and pay two all-reduces of the
    activations per layer (attention output, MLP output). Attention splits by KV head, so it
    stops scaling at ``num_kv_heads``; beyond it the KV heads are replicated, which also
    multiplies the KV memory per token by ``degree / num_kv_heads``.

    An all-reduce costs ``steps * allreduce_latency_s`` plus the ring's bandwidth term
    ``2 (degree - 1) / degree * bytes / link_bytes_per_s``; ``steps`` is the fewer of a
    ring's ``2 (degree - 1)`` and a tree's ``2 ceil(log2 degree)`` (NCCL takes a tree for
    small messages across nodes).
    """

    num_kv_heads: int
    hidden_size: int
    activation_bytes: int = 2  # bf16
    allreduce_latency_s: float = 10e-6  # per all-reduce step
    link_bytes_per_s: float = 100e9  # per-GPU link bandwidth of the all-reduce
    unsplit_dense_s: float = 0.0  # per layer, paid by every GPU at any degree

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.unsplit_dense_s < 0 or self.allreduce_latency_s < 0:
            raise ValueError("num_kv_heads must be positive; unsplit_dense_s and allreduce_latency_s >= 0")

    def kv_replication(self, degree: int) -> float:
        """How many copies of each KV head the ``degree`` GPUs hold."""
        return max(1.0, degree / self.num_kv_heads)

    def allreduce_time(self, degree: int, batch):
        """Seconds of one all-reduce of ``batch`` activation rows over ``degree`` GPUs."""
        if degree <= 1:
            return np.zeros_like(np.asarray(batch, dtype=np.float64))
        message_bytes = np.asarray(batch, dtype=np.float64) * self.hidden_size * self.activation_bytes
        steps = min(2 * (degree - 1), 2 * math.ceil(math.log2(degree)))
        return steps * self.allreduce_latency_s + 2 * (degree - 1) / degree * message_bytes / self.link_bytes_per_s

    def dense_time(self, model: PerfModel, degree: int, batch):
        """Per-layer non-attention time (s) of one GPU of the ``degree``, all-reduces included."""
        if degree < 1:
            raise ValueError(f"degree must be >= 1, got {degree}")
        dense = model.dense_time(batch)
        if degree == 1:
            return dense
        unsplit = np.minimum(self.unsplit_dense_s, dense)
        return unsplit + (dense - unsplit) / degree + 2 * self.allreduce_time(degree, batch)

    def layer_time(self, model: PerfModel, degree: int, batch, tokens):
        """Per-layer step time (s) at ``batch`` requests reading ``tokens`` KV tokens in total."""
        attention = model.attention_time(tokens) / min(degree, self.num_kv_heads)
        return self.dense_time(model, degree, batch) + attention


# -- fitting ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measurement:
    """One measured decode step: ``batch`` requests of ``context`` KV tokens each."""

    batch: int
    context: int  # KV tokens per request
    step_s: float  # whole step, all layers (s)


@dataclass(frozen=True)
class FitReport:
    """Errors of a fit. Percentages are mean absolute percentage errors (MAPE, in %)."""

    num_train: int
    num_holdout: int
    train_mape_pct: float
    holdout_mape_pct: float
    holdout_max_ape_pct: float
    holdout_points: tuple[tuple[int, int, float, float], ...] = field(default=())
    # (batch, context, measured step s, predicted step s) per held-out point


def _design(batch: np.ndarray, tokens: np.ndarray, knees: tuple[float | None, float | None]) -> np.ndarray:
    batch_knee, token_knee = knees
    columns = [np.ones_like(batch), batch, tokens]
    columns.append(np.maximum(batch - batch_knee, 0.0) if batch_knee is not None else np.zeros_like(batch))
    columns.append(np.maximum(tokens - token_knee, 0.0) if token_knee is not None else np.zeros_like(batch))
    return np.stack(columns, axis=1)


def _fit_linear(batch, tokens, layer_s, knees):
    """Least squares on relative error (rows scaled by 1/y), so that MAPE is what is minimised."""
    design = _design(batch, tokens, knees) / layer_s[:, None]
    coef, *_ = np.linalg.lstsq(design, np.ones_like(layer_s), rcond=None)
    return coef


def _mape(measured: np.ndarray, predicted: np.ndarray) -> np.ndarray:
    return np.abs(predicted - measured) / measured * 100.0


def fit(
    measurements: Sequence[Measurement],
    num_layers: int,
    *,
    holdout_fraction: float = 0.25,
    seed: int = 0,
    remote_overhead_s: float = 0.0,
    kv_bytes_per_token: int | None = None,
) -> tuple[PerfModel, FitReport]:
    """Fit a :class:`PerfModel` to measured steps; report the error on held-out points.

    A random ``holdout_fraction`` of the points is kept out of the fit; the knees of the dense
    and attention terms are chosen among the training batch sizes and token totals (or none)
    by the training error; each choice is a linear least-squares fit on relative error.

    Args:
        measurements: at least 6 points with at least 3 distinct batch sizes.
        num_layers: layers per step (the measured ``step_s`` covers all of them).
        remote_overhead_s: per-layer cost of remote parts, measured separately.
    """
    if len(measurements) < 6:
        raise ValueError(f"need at least 6 measurements to fit and hold out, got {len(measurements)}")
    if not 0 < holdout_fraction < 1:
        raise ValueError(f"holdout_fraction must be in (0, 1), got {holdout_fraction}")
    for m in measurements:
        if m.batch <= 0 or m.context < 0 or not (m.step_s > 0 and math.isfinite(m.step_s)):
            raise ValueError(f"bad measurement {m}: batch > 0, context >= 0 and step_s > 0 required")
    batch = np.array([m.batch for m in measurements], dtype=np.float64)
    tokens = np.array([m.batch * m.context for m in measurements], dtype=np.float64)
    layer_s = np.array([m.step_s for m in measurements], dtype=np.float64) / num_layers
    if len(np.unique(batch)) < 3:
        raise ValueError("need at least 3 distinct batch sizes")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(measurements))
    num_holdout = max(1, int(round(holdout_fraction * len(measurements))))
    holdout, train = order[:num_holdout], order[num_holdout:]

    best = None
    batch_knees: list[float | None] = [None] + sorted(set(batch[train].tolist()))[1:-1]
    token_knees: list[float | None] = [None] + sorted(set(tokens[train].tolist()))[1:-1]
    for knees in ((b, t) for b in batch_knees for t in token_knees):
        coef = _fit_linear(batch[train], tokens[train], layer_s[train], knees)
        # Attention must not get cheaper with more tokens anywhere: that would make hosting
        # tokens look like it speeds an instance up. Likewise dense time with more requests, and
        # a step of one request must take time (a noisy top point can tilt a fit either way).
        if coef[2] < 0 or coef[2] + coef[4] < 0:
            continue
        if coef[1] < 0 or coef[1] + coef[3] < 0 or coef[0] + coef[1] <= 0:
            continue
        predicted = _design(batch[train], tokens[train], knees) @ coef
        error = float(_mape(layer_s[train], predicted).mean())
        if best is None or error < best[0] - 1e-9:
            best = (error, knees, coef)
    if best is None:
        raise ValueError("no fit whose attention and dense costs never fall with more tokens or requests: "
                         "are the times noise?")
    _, (batch_knee, token_knee), coef = best
    model = PerfModel(
        num_layers=num_layers,
        dense_fixed_s=float(coef[0]),
        dense_per_seq_s=float(coef[1]),
        attn_s_per_token=float(coef[2]),
        dense_knee_batch=batch_knee,
        dense_per_seq_above_knee_s=float(coef[3]) if batch_knee is not None else 0.0,
        attn_knee_tokens=token_knee,
        attn_s_per_token_above_knee=float(coef[4]) if token_knee is not None else 0.0,
        remote_overhead_s=remote_overhead_s,
        kv_bytes_per_token=kv_bytes_per_token,
    )
    predict = lambda idx: (model.dense_time(batch[idx]) + model.attention_time(tokens[idx])) * num_layers  # noqa: E731
    step_s = layer_s * num_layers
    train_err = _mape(step_s[train], predict(train))
    hold_err = _mape(step_s[holdout], predict(holdout))
    report = FitReport(
        num_train=len(train),
        num_holdout=len(holdout),
        train_mape_pct=float(train_err.mean()),
        holdout_mape_pct=float(hold_err.mean()),
        holdout_max_ape_pct=float(hold_err.max()),
        holdout_points=tuple(
            (int(batch[i]), int(tokens[i] // batch[i]), float(step_s[i]), float(p))
            for i, p in zip(holdout, predict(holdout))
        ),
    )
    return model, report


# -- JSON ------------------------------------------------------------------------------------
def save_model(path: str | Path, model: PerfModel, report: FitReport | None = None, **metadata) -> None:
    """Write the model (and its fit report and any metadata) as JSON."""
    document = {"format_version": FORMAT_VERSION, "model": asdict(model)}
    if report is not None:
        document["fit_report"] = asdict(report)
    document.update(metadata)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


def load_model(path: str | Path) -> PerfModel:
    """Read a model written by :func:`save_model`."""
    document = json.loads(Path(path).read_text())
    if document.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: format_version {document.get('format_version')} is not {FORMAT_VERSION}")
    return PerfModel(**document["model"])
