"""The gManager's placement policy: the Infinite-LLM paper's greedy debtor/creditor plan.

``plan(snapshot, model, thresholds) -> list[Move]`` is a pure function of frozen data.

* Debtors: instances whose batch is below ``thresholds.debtor_max_batch`` (they are memory
  bound: their KV leaves no room for more requests), taken by batch ascending.
* Creditors: instances whose memory use is below ``thresholds.creditor_max_used_fraction``,
  taken by use ascending (the ``creditors_per_debtor`` least used are tried).
* For each debtor in turn, its longest request (most local blocks) is offered to every
  creditor; for each creditor the number of blocks ``k`` with the best predicted cluster
  throughput gain is found; the best (creditor, k) is applied to the working state and
  recorded; the debtor is offered again until no move gains, then the next debtor.

The predicted throughput of an instance (:func:`_throughput_parts`) counts the waiting requests
its free memory admits: ``admitted = min(num_waiting, free_blocks / blocks_per_waiting)``
(fractional, the expected batch growth), each bringing ``blocks_per_waiting`` blocks of KV.
So moving ``k`` blocks off a debtor grows its batch while its local KV stays the same; a
creditor pays ``k`` blocks more attention and, if it has a queue of its own, admits fewer.
A debtor's own attention is ``max(local, largest remote part)`` (its creditors work in
parallel with it), see :mod:`.perf_model`.

The best ``k`` is searched two ways that give the same plan:

* ``search="scan"``: every ``k`` from 1 to the most that can move (the paper's scan);
* ``search="breakpoints"`` (default): the gain is piecewise a sum of two linear-fractional
  functions of ``k`` (each instance's batch and step time are linear in ``k`` between the
  points where a ``min``/``max`` switches, a knee is crossed or a queue runs dry). Such a sum
  has at most one stationary point per piece, where ``D_c / D_d = sqrt(-A_c / A_d)`` has a
  closed form, so the best integer ``k`` is a piece end or next to that point: a few dozen
  candidates per creditor instead of up to the request's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterator, Literal

import numpy as np

from .perf_model import PerfModel


# -- snapshot --------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestPlacementEntry:
    """Blocks of one request held on one instance."""

    req_id: int
    inst_id: int
    num_blocks: int
    local: bool  # True: the request's home (it runs the request's steps); False: a creditor
    movable: bool = True  # False: none of these blocks may move yet (e.g. the prompt is being written)


@dataclass(frozen=True)
class InstanceState:
    """One instance as its last heartbeat described it. Memory in blocks."""

    inst_id: int
    total_blocks: int
    free_blocks: int
    num_waiting: int = 0  # requests queued at this instance for lack of memory
    waiting_blocks: int = 0  # blocks those requests need to be admitted, together

    def __post_init__(self) -> None:
        for name in ("total_blocks", "free_blocks", "num_waiting", "waiting_blocks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"instance {self.inst_id}: {name} must be an integer >= 0, got {value!r}")
        if self.free_blocks > self.total_blocks:
            raise ValueError(f"instance {self.inst_id}: free_blocks {self.free_blocks} > total_blocks {self.total_blocks}")
        if (self.num_waiting == 0) != (self.waiting_blocks == 0):
            raise ValueError(f"instance {self.inst_id}: num_waiting and waiting_blocks must be both zero or both positive")


@dataclass(frozen=True, eq=False)
class PlacementTable:
    """Where every request's blocks are: one row per (request, instance), as numpy columns.

    Columns rather than a tuple of :class:`RequestPlacementEntry`: a snapshot of 100,000
    requests is read in a few milliseconds this way. The arrays are made read-only.
    """

    req_id: np.ndarray  # [num_entries] int64
    inst_id: np.ndarray  # [num_entries] int64
    num_blocks: np.ndarray  # [num_entries] int64
    local: np.ndarray  # [num_entries] bool
    movable: np.ndarray | None = None  # [num_entries] bool (RequestPlacementEntry.movable); None: all

    def __post_init__(self) -> None:
        if self.movable is None:
            object.__setattr__(self, "movable", np.ones(len(self.req_id), np.bool_))
        columns = {}
        for name, dtype in (("req_id", np.int64), ("inst_id", np.int64), ("num_blocks", np.int64), ("local", np.bool_),
                            ("movable", np.bool_)):
            array = np.array(getattr(self, name), dtype=dtype).reshape(-1)
            array.setflags(write=False)
            columns[name] = array
            object.__setattr__(self, name, array)
        if len({a.shape[0] for a in columns.values()}) != 1:
            raise ValueError("placement columns must have one length")

    @classmethod
    def from_entries(cls, entries) -> "PlacementTable":
        entries = list(entries)
        return cls(
            [e.req_id for e in entries], [e.inst_id for e in entries],
            [e.num_blocks for e in entries], [e.local for e in entries], [e.movable for e in entries],
        )

    def __len__(self) -> int:
        return self.req_id.shape[0]

    def entries(self) -> Iterator[RequestPlacementEntry]:
        for row in zip(self.req_id.tolist(), self.inst_id.tolist(), self.num_blocks.tolist(), self.local.tolist(),
                       self.movable.tolist()):
            yield RequestPlacementEntry(*row)


@dataclass(frozen=True, eq=False)
class ClusterSnapshot:
    """What the gManager knows of the cluster at one moment."""

    block_size: int  # tokens per block
    instances: tuple[InstanceState, ...]
    placement: PlacementTable = field(default_factory=lambda: PlacementTable([], [], [], []))


@dataclass(frozen=True)
class Move:
    """Move ``num_blocks`` of a request's blocks held on ``src_inst`` to ``dst_inst``."""

    req_id: int
    src_inst: int
    dst_inst: int
    num_blocks: int
    predicted_gain: float  # cluster decode throughput gained, tokens/s


@dataclass(frozen=True)
class Thresholds:
    """Which instances take part, and when to stop."""

    debtor_max_batch: int  # an instance with a batch below this is a debtor
    creditor_max_used_fraction: float  # an instance with less memory in use than this is a creditor
    max_moves: int = 64  # per plan: the snapshot grows stale as moves are applied
    creditors_per_debtor: int | None = 32  # the least used creditors tried per move; None: all
    min_relative_gain: float = 1e-6  # a move must gain this fraction of the pair's throughput

    def __post_init__(self) -> None:
        if not 0 <= self.creditor_max_used_fraction <= 1:
            raise ValueError(f"creditor_max_used_fraction must be in [0, 1], got {self.creditor_max_used_fraction}")
        for name in ("max_moves", "debtor_max_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.creditors_per_debtor is not None and self.creditors_per_debtor <= 0:
            raise ValueError(f"creditors_per_debtor must be positive or None, got {self.creditors_per_debtor}")
        if not (math.isfinite(self.min_relative_gain) and self.min_relative_gain >= 0):
            raise ValueError(f"min_relative_gain must be finite and >= 0, got {self.min_relative_gain}")


# -- validation and the working state ---------------------------------------------------------
class _State:
    """Per-instance aggregates (numpy, indexed by position in ``snapshot.instances``). Tokens
    are blocks times ``block_size``: a request's last block counts as full."""

    def __init__(self, snapshot: ClusterSnapshot) -> None:
        if snapshot.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {snapshot.block_size}")
        instances = snapshot.instances
        self.inst_ids = np.array([i.inst_id for i in instances], dtype=np.int64)
        if len(np.unique(self.inst_ids)) != len(self.inst_ids):
            raise ValueError("instance ids in the snapshot must be unique")
        num = len(instances)
        self.total = np.array([i.total_blocks for i in instances], dtype=np.float64)
        self.free = np.array([i.free_blocks for i in instances], dtype=np.float64)
        self.num_waiting = np.array([i.num_waiting for i in instances], dtype=np.float64)
        waiting_blocks = np.array([i.waiting_blocks for i in instances], dtype=np.float64)
        self.blocks_per_waiting = np.divide(waiting_blocks, self.num_waiting, out=np.ones(num), where=self.num_waiting > 0)

        table = snapshot.placement
        if len(table) and table.num_blocks.min() < 0:
            bad = int(np.argmin(table.num_blocks))
            raise ValueError(f"request {table.req_id[bad]}: negative block count {table.num_blocks[bad]}")
        order = np.argsort(self.inst_ids, kind="stable")
        pos = np.searchsorted(self.inst_ids[order], table.inst_id)
        pos = np.minimum(pos, max(num - 1, 0))
        known = (self.inst_ids[order][pos] == table.inst_id) if num else np.zeros(len(table), bool)
        if not known.all():
            bad = int(np.argmin(known))
            raise ValueError(f"request {table.req_id[bad]} is placed on unknown instance {table.inst_id[bad]}")
        entry_inst = order[pos]  # index of each entry's instance

        B = float(snapshot.block_size)
        local = table.local
        local_reqs = table.req_id[local]
        local_order = np.argsort(local_reqs, kind="stable")
        sorted_reqs = local_reqs[local_order]
        twice = sorted_reqs[1:] == sorted_reqs[:-1]
        if twice.any():
            raise ValueError(f"request {sorted_reqs[1:][twice][0]} has more than one home (local entry)")
        remote_reqs = table.req_id[~local]
        if len(remote_reqs):
            home_pos = np.minimum(np.searchsorted(sorted_reqs, remote_reqs), max(len(sorted_reqs) - 1, 0))
            homeless = (sorted_reqs[home_pos] != remote_reqs) if len(sorted_reqs) else np.ones(len(remote_reqs), bool)
            if homeless.any():
                raise ValueError(f"request {remote_reqs[homeless][0]} has remote blocks but no home (local entry)")
        used = np.bincount(entry_inst, weights=table.num_blocks, minlength=num)
        over = used > self.total - self.free
        if over.any():
            bad = int(np.argmax(over))
            raise ValueError(
                f"instance {self.inst_ids[bad]}: placement holds {int(used[bad])} blocks but only "
                f"{int(self.total[bad] - self.free[bad])} are in use"
            )

        self.batch = np.bincount(entry_inst[local], minlength=num).astype(np.float64)
        self.own_local_tokens = np.bincount(entry_inst[local], weights=table.num_blocks[local], minlength=num) * B
        self.hosted_tokens = np.bincount(entry_inst[~local], weights=table.num_blocks[~local], minlength=num) * B
        # Remote parts per (home, creditor): sparse, kept as dicts for the debtors that have any.
        self.parts: dict[int, dict[int, float]] = {}
        if len(remote_reqs):
            remote_home = entry_inst[local][local_order][home_pos]
            pair = remote_home * num + entry_inst[~local]
            pairs, inverse = np.unique(pair, return_inverse=True)
            sums = np.bincount(inverse, weights=table.num_blocks[~local]) * B
            for key, tokens in zip(pairs.tolist(), sums.tolist()):
                if tokens > 0:  # a row of 0 blocks is no remote part (apply_moves drops such rows too)
                    self.parts.setdefault(key // num, {})[key % num] = tokens
        self.largest_part = np.zeros(num)
        self.has_remote = np.zeros(num)
        for home, parts in self.parts.items():
            self.largest_part[home] = max(parts.values())
            self.has_remote[home] = 1.0
        # Local requests per instance, for the debtors' "longest request".
        self.local_req_id = table.req_id[local]
        self.local_inst = entry_inst[local]
        self.local_blocks = table.num_blocks[local].astype(np.int64).copy()
        self.local_movable = table.movable[local]
        self.block_size = B

    def local_rows(self, instances: np.ndarray) -> dict[int, np.ndarray]:
        """Rows of the movable local entries of each of ``instances`` (one pass over the table)."""
        wanted = np.zeros(len(self.inst_ids), bool)
        wanted[instances] = True
        rows = np.flatnonzero(wanted[self.local_inst] & self.local_movable)
        rows = rows[np.argsort(self.local_inst[rows], kind="stable")]
        cuts = np.flatnonzero(np.diff(self.local_inst[rows])) + 1
        return {int(self.local_inst[group[0]]): group for group in np.split(rows, cuts) if len(group)}


def _throughput_parts(model: PerfModel, B, batch, own_tokens, free, num_waiting, per_waiting, largest_part, has_remote):
    """(effective batch, per-layer time) of instances in a given state; numpy-broadcast.

    The effective batch counts the waiting requests the free blocks admit, fractions included
    (an expectation); a step runs at least one request, so its dense time is taken at a batch
    of at least 1: an instance that admits a fraction of a request is not faster for it.
    """
    admitted = np.minimum(num_waiting, free / per_waiting)
    batch_eff = batch + admitted
    local_tokens = own_tokens + admitted * per_waiting * B
    attention_tokens = np.maximum(local_tokens, largest_part)
    layer_s = (model.dense_time(np.maximum(batch_eff, 1.0)) + model.attention_time(attention_tokens)
               + model.remote_overhead_s * has_remote)
    return batch_eff, layer_s


class _Pair:
    """One debtor request offered to a set of creditors: the gain as a function of k."""

    def __init__(self, state: _State, model: PerfModel, debtor: int, creditors: np.ndarray) -> None:
        s = state
        self.model, self.B, self.L = model, s.block_size, model.num_layers
        d = debtor
        parts = s.parts.get(d, {})
        self.part = np.array([parts.get(int(c), 0.0) for c in creditors]) if parts else np.zeros(len(creditors))
        # The debtor's largest part on any creditor other than the candidate.
        if parts:
            ranked = sorted(parts.items(), key=lambda item: -item[1])
            top_c, top = ranked[0]
            second = ranked[1][1] if len(ranked) > 1 else 0.0
            self.other_part = np.where(creditors == top_c, second, top)
        else:
            self.other_part = np.zeros(len(creditors))
        self.d = dict(
            batch=s.batch[d], own=s.own_local_tokens[d] + s.hosted_tokens[d], free=s.free[d],
            waiting=s.num_waiting[d], per=s.blocks_per_waiting[d], has_remote=s.has_remote[d],
        )
        c = creditors
        self.c = dict(
            batch=s.batch[c][:, None], own=(s.own_local_tokens[c] + s.hosted_tokens[c])[:, None],
            free=s.free[c][:, None], waiting=s.num_waiting[c][:, None], per=s.blocks_per_waiting[c][:, None],
            part=s.largest_part[c][:, None], has_remote=s.has_remote[c][:, None],
        )
        self.part2 = self.part[:, None]
        self.other2 = self.other_part[:, None]
        base = self.throughputs(np.zeros((len(creditors), 1)))
        self.base = (base[0] / (self.L * base[1]) + base[2] / (self.L * base[3]))[:, 0]

    def throughputs(self, k: np.ndarray):
        """(debtor batch, debtor time, creditor batch, creditor time) after moving k blocks."""
        d, c, B = self.d, self.c, self.B
        moved = k > 0
        nd, td = _throughput_parts(
            self.model, B, d["batch"], d["own"] - k * B, d["free"] + k, d["waiting"], d["per"],
            np.maximum(self.other2, self.part2 + k * B), np.maximum(d["has_remote"], moved),
        )
        nc, tc = _throughput_parts(
            self.model, B, c["batch"], c["own"] + k * B, c["free"] - k, c["waiting"], c["per"],
            c["part"], c["has_remote"],
        )
        return nd, td, nc, tc

    def gain(self, k: np.ndarray) -> np.ndarray:
        nd, td, nc, tc = self.throughputs(k)
        return (nd / (self.L * td) + nc / (self.L * tc)) - self.base[:, None]

    def breakpoints(self) -> np.ndarray:
        """Real k where a piece of the gain ends: ``[num_creditors, num_points]``."""
        d, c, B, m = self.d, self.c, self.B, self.model
        points = []
        A, f, W, per = d["own"], d["free"], d["waiting"], d["per"]
        cap_local = A + W * per * B  # the debtor's local tokens after its queue ran dry, at k = 0
        p, other = self.part2, self.other2
        points += [W * per - f + 0 * p, (A + f * B - p) / B, (cap_local - p) / (2 * B), (cap_local - other) / B,
                   (other - p) / B]
        Ac, fc, Wc, perc, Rc = c["own"], c["free"], c["waiting"], c["per"], c["part"]
        points += [fc - Wc * perc, (Rc - Ac - Wc * perc * B) / B]
        # Where the effective batch crosses 1 (below it the dense time stays at one request's)
        # and the dense knee.
        for knee in (1.0, m.dense_knee_batch):
            if knee is not None:
                points += [(knee - d["batch"]) * per - f + 0 * p, fc - (knee - c["batch"]) * perc]
        if m.attn_knee_tokens is not None:
            knee = m.attn_knee_tokens
            points += [(cap_local - knee) / B + 0 * p, (knee - p) / B, (knee - Ac - Wc * perc * B) / B]
        return np.concatenate(np.broadcast_arrays(*points), axis=1)


def _best_k_scan(pair: _Pair, k_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every k from 1 to k_max per creditor; ties go to the smallest k."""
    best_k = np.zeros(len(k_max), dtype=np.int64)
    best_gain = np.full(len(k_max), -np.inf)
    for row, top in enumerate(k_max.tolist()):
        if top < 1:
            continue
        sub = _Pair.__new__(_Pair)
        sub.__dict__.update(pair.__dict__)
        sub.c = {key: value[row : row + 1] for key, value in pair.c.items()}
        sub.part2, sub.other2 = pair.part2[row : row + 1], pair.other2[row : row + 1]
        sub.base = pair.base[row : row + 1]
        gains = sub.gain(np.arange(1, top + 1, dtype=np.float64)[None, :])[0]
        best = int(np.argmax(gains))
        best_k[row], best_gain[row] = best + 1, gains[best]
    return best_k, best_gain


def _best_k_breakpoints(pair: _Pair, k_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Piece ends and the per-piece stationary points; ties go to the smallest k."""
    top = k_max[:, None].astype(np.float64)
    real = pair.breakpoints()
    with np.errstate(invalid="ignore"):
        bounds = np.concatenate([np.floor(real), np.ceil(real), np.ones_like(top), top], axis=1)
    bounds = np.clip(np.nan_to_num(bounds, nan=1.0, posinf=1.0, neginf=1.0), 1.0, np.maximum(top, 1.0))
    bounds.sort(axis=1)
    lo, hi = bounds[:, :-1], bounds[:, 1:]
    # Inside a piece of length >= 2 the gain is (a + b t)/(c + e t) + (a' + b' t)/(c' + e' t):
    # read the two lines of each instance from t = 0 and t = 1.
    nd0, td0, nc0, tc0 = pair.throughputs(lo)
    nd1, td1, nc1, tc1 = pair.throughputs(lo + 1.0)
    slope_d = (nd1 - nd0) * td0 - nd0 * (td1 - td0)  # sign of d/dt of the debtor's term
    slope_c = (nc1 - nc0) * tc0 - nc0 * (tc1 - tc0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.sqrt(-slope_c / slope_d)  # T_c / T_d at the stationary point
        t = (ratio * td0 - tc0) / ((tc1 - tc0) - ratio * (td1 - td0))
    usable = (hi - lo >= 2) & (slope_d * slope_c < 0) & np.isfinite(t) & (t > 0) & (t < hi - lo)
    t = np.where(usable, np.floor(np.where(usable, t, 0.0)), 0.0)
    candidates = np.concatenate([bounds, lo + t, np.minimum(lo + t + 1.0, hi)], axis=1)
    gains = pair.gain(candidates)
    gains = np.where((candidates >= 1) & (candidates <= top), gains, -np.inf)
    best_gain = gains.max(axis=1)
    # Smallest k among the candidates that reach the best gain, as the scan would pick.
    best_k = np.where(gains == best_gain[:, None], candidates, np.inf).min(axis=1)
    best_k = np.where(np.isfinite(best_k) & (k_max >= 1), best_k, 0).astype(np.int64)
    return best_k, np.where(k_max >= 1, best_gain, -np.inf)


Search = Literal["breakpoints", "scan"]


def plan(
    snapshot: ClusterSnapshot, model: PerfModel, thresholds: Thresholds, *, search: Search = "breakpoints"
) -> list[Move]:
    """The moves of KV blocks that the perf model predicts raise cluster decode throughput.

    Args:
        snapshot: the cluster (validated: unknown instance ids, negative counts, a request
            with no or two homes, more blocks placed than in use raise ``ValueError``).
        model: per-layer step times.
        thresholds: who is a debtor or a creditor, and the limits of one plan.
        search: ``"breakpoints"`` (fast) or ``"scan"`` (every k, the reference).

    Returns:
        Moves in the order they were chosen; each assumes the ones before it were applied.
    """
    if search not in ("breakpoints", "scan"):
        raise ValueError(f"search must be 'breakpoints' or 'scan', got {search!r}")
    state = _State(snapshot)
    best_k = _best_k_breakpoints if search == "breakpoints" else _best_k_scan
    used_fraction = np.divide(state.total - state.free, state.total, out=np.ones_like(state.total), where=state.total > 0)
    debtors = np.flatnonzero((state.batch > 0) & (state.batch < thresholds.debtor_max_batch))
    debtors = debtors[np.lexsort((state.inst_ids[debtors], state.batch[debtors]))]
    moves: list[Move] = []
    rows_of = state.local_rows(debtors)
    for debtor in debtors.tolist():
        mine = rows_of.get(debtor, np.zeros(0, np.int64))
        while len(moves) < thresholds.max_moves and len(mine):
            row = mine[np.argmax(state.local_blocks[mine])]
            # The newest block stays home: new tokens are written there.
            movable = int(state.local_blocks[row]) - 1
            if movable < 1:
                break
            # A creditor takes only what keeps it within creditor_max_used_fraction: the rest of
            # its pool is for the next blocks of its own requests (epsilon: 0.57 * 100 is 56.99...).
            room = np.floor(thresholds.creditor_max_used_fraction * state.total - (state.total - state.free) + 1e-9)
            is_creditor = room >= 1
            is_creditor[debtor] = False
            creditors = np.flatnonzero(is_creditor)
            if not len(creditors):
                break
            creditors = creditors[np.lexsort((state.inst_ids[creditors], used_fraction[creditors]))]
            creditors = creditors[: thresholds.creditors_per_debtor]
            pair = _Pair(state, model, debtor, creditors)
            k_max = np.minimum(np.minimum(state.free[creditors], room[creditors]).astype(np.int64), movable)
            ks, gains = best_k(pair, k_max)
            choice = int(np.argmax(gains))  # first creditor (least used) among equals
            gain = float(gains[choice])
            if not gain > thresholds.min_relative_gain * float(pair.base[choice]):
                break
            creditor, k = int(creditors[choice]), int(ks[choice])
            _apply(state, row, debtor, creditor, k)
            used_fraction[debtor] = (state.total[debtor] - state.free[debtor]) / state.total[debtor]
            used_fraction[creditor] = (state.total[creditor] - state.free[creditor]) / state.total[creditor]
            moves.append(Move(int(state.local_req_id[row]), int(state.inst_ids[debtor]), int(state.inst_ids[creditor]), k, gain))
        if len(moves) >= thresholds.max_moves:
            break
    return moves


def _apply(state: _State, row: int, debtor: int, creditor: int, k: int) -> None:
    tokens = k * state.block_size
    state.local_blocks[row] -= k
    state.own_local_tokens[debtor] -= tokens
    state.free[debtor] += k
    state.hosted_tokens[creditor] += tokens
    state.free[creditor] -= k
    parts = state.parts.setdefault(debtor, {})
    parts[creditor] = parts.get(creditor, 0.0) + tokens
    state.largest_part[debtor] = max(parts.values())
    state.has_remote[debtor] = 1.0


def predicted_cluster_throughput(snapshot: ClusterSnapshot, model: PerfModel) -> float:
    """Decode tokens/s the model predicts for a snapshot (waiting requests admitted as memory allows)."""
    s = _State(snapshot)
    batch, layer_s = _throughput_parts(
        model, s.block_size, s.batch, s.own_local_tokens + s.hosted_tokens, s.free, s.num_waiting,
        s.blocks_per_waiting, s.largest_part, s.has_remote,
    )
    return float((batch / (model.num_layers * layer_s)).sum())


def apply_moves(snapshot: ClusterSnapshot, moves: list[Move]) -> ClusterSnapshot:
    """The snapshot after ``moves`` (for tests and the simulator's bookkeeping)."""
    free = {i.inst_id: i.free_blocks for i in snapshot.instances}
    rows: dict[tuple[int, int, bool], int] = {}
    unmovable: set[tuple[int, int]] = set()
    for e in snapshot.placement.entries():
        rows[(e.req_id, e.inst_id, e.local)] = rows.get((e.req_id, e.inst_id, e.local), 0) + e.num_blocks
        if not e.movable:
            unmovable.add((e.req_id, e.inst_id))
    for move in moves:
        key = (move.req_id, move.src_inst, True)
        if (rows.get(key, 0) < move.num_blocks or free.get(move.dst_inst, -1) < move.num_blocks
                or (move.req_id, move.src_inst) in unmovable):
            raise ValueError(f"{move} does not fit the snapshot")
        rows[key] -= move.num_blocks
        rows[(move.req_id, move.dst_inst, False)] = rows.get((move.req_id, move.dst_inst, False), 0) + move.num_blocks
        free[move.src_inst] += move.num_blocks
        free[move.dst_inst] -= move.num_blocks
    instances = tuple(
        InstanceState(i.inst_id, i.total_blocks, free[i.inst_id], i.num_waiting, i.waiting_blocks) for i in snapshot.instances
    )
    entries = [RequestPlacementEntry(r, i, n, loc, (r, i) not in unmovable) for (r, i, loc), n in rows.items() if n > 0 or loc]
    return ClusterSnapshot(snapshot.block_size, instances, PlacementTable.from_entries(entries))


__all__ = [
    "ClusterSnapshot",
    "InstanceState",
    "Move",
    "PlacementTable",
    "RequestPlacementEntry",
    "Thresholds",
    "apply_moves",
    "plan",
    "predicted_cluster_throughput",
]
