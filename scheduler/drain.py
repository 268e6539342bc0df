"""Draining an instance: which blocks leave it and where they go (pure: no clock, no I/O).

A drain empties instance D so that it may stop:

* every segment D holds for another home H moves to a live, non-draining instance other than
  D and H (a creditor-to-creditor move, carried out by H: ``MoveKV(src=D, dst=X)`` to H);
* the full blocks of D's own requests move off D too (home moves, ``MoveKV(home=D, src=D,
  dst=X)`` to D): D's requests still finish on D, whose clients are connected to D, but their KV stops
  taking D's memory. The newest block of each stays, as new tokens are written into it.

:func:`plan_drain` takes a :class:`DrainSnapshot` built from heartbeats and returns a
:class:`DrainPlan`, or raises :class:`UnknownInstance`, :class:`DrainRefused` (no room for what
D holds was found: nothing may be sent) or ``ValueError`` (an inconsistent snapshot).
:func:`drain_figures` says from the same snapshot whether D is safe to stop. The gManager sends
the plan and plans again from newer heartbeats until nothing is left on D.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownInstance(LookupError):
    """The instance to drain is not live (no recent heartbeat)."""


class DrainRefused(ValueError):
    """No placement of what the instance holds was found (the other instances lack room for it,
    or the search for one gave up); nothing was planned."""


@dataclass(frozen=True)
class DrainInstance:
    """One live instance as its last heartbeat described it."""

    inst_id: int
    num_blocks_free: int  # blocks neither used nor reserved
    num_blocks_lent: int  # blocks it holds (or has reserved) for other homes' requests
    num_running: int  # requests running there (its batch)
    draining: bool  # a drain of it is under way: it takes no blocks


@dataclass(frozen=True)
class DrainEntry:
    """Blocks of one request on one instance, as the request's home reports them."""

    home_inst_id: int  # the request's home
    req_id: int  # the home's request id
    inst_id: int  # the instance holding the blocks
    num_blocks: int  # blocks


@dataclass(frozen=True)
class DrainSnapshot:
    instances: tuple[DrainInstance, ...]  # live instances
    entries: tuple[DrainEntry, ...]  # every live home's placement


@dataclass(frozen=True)
class DrainMove:
    """Move ``num_blocks`` blocks of request ``(home_inst_id, req_id)`` from ``src_inst_id``."""

    home_inst_id: int  # the request's home: it carries the move out
    req_id: int
    src_inst_id: int  # the drained instance
    dst_inst_id: int
    num_blocks: int  # blocks

    @property
    def kind(self) -> str:
        """``"held"``: a segment held for another home; ``"own"``: the drained home's own blocks."""
        return "own" if self.src_inst_id == self.home_inst_id else "held"


@dataclass(frozen=True)
class DrainPlan:
    inst_id: int  # the drained instance
    moves: tuple[DrainMove, ...]  # held segments first, then own blocks; each largest first
    num_blocks_held: int  # blocks it holds for other homes (all move)
    num_blocks_own_movable: int  # full blocks of its own requests (all move)
    num_blocks_free_elsewhere: int  # free blocks of the live, non-draining other instances


@dataclass(frozen=True)
class DrainFigures:
    """How far a drain has come, from the drained instance's and the homes' heartbeats."""

    num_running: int  # requests still running on the drained instance
    num_own_requests: int  # its requests the placement still names (running or waiting)
    num_blocks_held: int  # blocks it holds or reserved for others, by its own count
    num_blocks_on_it: int  # blocks other homes report on it

    @property
    def safe_to_stop(self) -> bool:
        return (self.num_running == 0 and self.num_own_requests == 0 and self.num_blocks_held == 0
                and self.num_blocks_on_it == 0)


def plan_drain(snapshot: DrainSnapshot, inst_id: int, own_blocks: bool = True) -> DrainPlan:
    """The moves that empty ``inst_id``; with ``own_blocks`` False only the segments it holds
    for other homes (an instance that stops hands over those and finishes its own requests,
    whose blocks free as they end).

    Each request's blocks on the drained instance go to one destination, never the drained
    instance, a draining one, or the request's home for a held segment (a home does not take
    blocks back on command). Held segments are placed first, then own blocks, each group
    largest first (ties: the lower home, then request id); each goes to the allowed instance
    with the most free blocks left (ties: the lower id), which spreads the load. When that
    leaves a request with nowhere to go, the placement backtracks (:func:`_place`): a
    drain is refused only when no placement exists, or when none was found within
    ``_MAX_BACKTRACK_STEPS`` steps of backtracking (the message says which). The plan depends
    only on the snapshot's contents, not on the order of its instances or entries.

    Raises UnknownInstance for an instance not in the snapshot, ValueError for an
    inconsistent snapshot, and DrainRefused as above.
    """
    by_id = _instances_by_id(snapshot)
    if inst_id not in by_id:
        raise UnknownInstance(f"unknown instance {inst_id} (no recent heartbeat)")
    free = {i.inst_id: i.num_blocks_free for i in snapshot.instances if i.inst_id != inst_id and not i.draining}
    free_elsewhere = sum(free.values())

    held: dict[tuple[int, int], int] = {}  # (home, req) -> blocks on the drained instance
    own: dict[int, int] = {}  # req -> local blocks of the drained instance's own requests
    for e in snapshot.entries:
        if e.inst_id != inst_id or e.num_blocks <= 0:
            continue
        if e.home_inst_id == inst_id:
            own[e.req_id] = own.get(e.req_id, 0) + e.num_blocks
        elif e.home_inst_id in by_id:  # a silent home's segments are freed by the holder's timeout
            held[(e.home_inst_id, e.req_id)] = held.get((e.home_inst_id, e.req_id), 0) + e.num_blocks
    # The newest block of a running request is being written: it stays.
    own_movable = {req: n - 1 for req, n in own.items() if n > 1} if own_blocks else {}
    num_held, num_own = sum(held.values()), sum(own_movable.values())
    if num_held + num_own > free_elsewhere:
        raise DrainRefused(
            f"instance {inst_id} holds {num_held} blocks for other instances and its requests have {num_own} "
            f"movable blocks, but the other live instances have only {free_elsewhere} free blocks")

    wanted = [((home, req), n) for (home, req), n in held.items()]
    wanted += [((inst_id, req), n) for req, n in own_movable.items()]
    # Held segments first (the drain cannot end without them), each group largest first.
    wanted.sort(key=lambda w: (w[0][0] == inst_id, -w[1], w[0]))
    for (home, req), num_blocks in wanted:
        most_free = max((n for i, n in free.items() if i != home), default=0)
        if most_free < num_blocks:
            raise DrainRefused(
                f"request {req} of instance {home} has {num_blocks} blocks on instance {inst_id} and no other "
                f"live instance{'' if home == inst_id else ' than its home'} has that many free "
                f"(most free: {most_free})")
    try:
        dsts = _place([n for _, n in wanted], [home for (home, _), _ in wanted], free)
    except _SearchExhausted:
        raise DrainRefused(
            f"no placement of the {len(wanted)} requests' blocks on instance {inst_id} ({num_held + num_own} "
            f"blocks; {free_elsewhere} free elsewhere) was found within {_MAX_BACKTRACK_STEPS} steps of "
            f"backtracking; one may exist") from None
    if dsts is None:
        raise DrainRefused(
            f"instance {inst_id} holds {num_held} blocks for other instances and its requests have {num_own} "
            f"movable blocks, and the other live instances have {free_elsewhere} free blocks, but in no "
            f"placement does each request's blocks fit on one instance (a held segment not at its home)")
    moves = [DrainMove(home, req, inst_id, dst, n) for ((home, req), n), dst in zip(wanted, dsts)]
    return DrainPlan(inst_id, tuple(moves), num_held, num_own, free_elsewhere)


# Bounds the placement search beyond the greedy path's one step (one request placed) per request: the
# gManager plans on its event loop, and a step takes ~0.13 ms at a thousand instances (a search
# that gives up there takes ~0.4 s, ~25 ms at 64 instances).
_MAX_BACKTRACK_STEPS = 2_000


class _SearchExhausted(Exception):
    """The placement search backtracked ``_MAX_BACKTRACK_STEPS`` steps without an answer."""


def _place(sizes: list[int], homes: list[int], free: dict[int, int]) -> list[int] | None:
    """Destinations for requests of ``sizes`` blocks, in order, each on one instance of ``free``
    (free blocks by instance) other than its entry in ``homes``; None when none exists. Raises
    _SearchExhausted when neither is known within ``len(sizes) + _MAX_BACKTRACK_STEPS`` steps.

    A depth-first search that tries the instance with the most free blocks first (ties: the
    lower id), so its first path spreads the blocks as the plain greedy placement does, and it
    backtracks only where that leaves a request nowhere to go. Pruned: instances
    equal in free blocks and home to no later request lead to the same outcome (only the lower
    id is tried); states that failed once are remembered; requests left needing more blocks
    than are free fail at once.
    """
    n = len(sizes)
    if n == 0:
        return []
    free = dict(free)
    total_free = sum(free.values())
    rest = [0] * (n + 1)  # blocks of requests k.. in rest[k]
    later_homes: list[frozenset[int]] = [frozenset()] * (n + 1)  # homes of requests k..
    for k in reversed(range(n)):
        rest[k] = rest[k + 1] + sizes[k]
        later_homes[k] = later_homes[k + 1] | {homes[k]} if homes[k] in free else later_homes[k + 1]
    failed: set[tuple] = set()

    def state(k: int) -> tuple:
        # Instances no later request calls home differ only in their free blocks.
        named = tuple(free[i] for i in sorted(later_homes[k]))
        return k, named, tuple(sorted(m for i, m in free.items() if i not in later_homes[k]))

    def options(k: int) -> list[int]:
        """Destinations of request k, the most free last (the search pops from the end)."""
        chosen, seen = [], set()
        for i in sorted((i for i in free if i != homes[k] and free[i] >= sizes[k]), key=lambda i: (-free[i], i)):
            outcome = (free[i], i if i in later_homes[k + 1] else None)
            if outcome not in seen:
                seen.add(outcome)
                chosen.append(i)
        return chosen[::-1]

    def node(k: int) -> list:
        # Until a state has failed there is none to look up (the greedy path pays no lookups).
        hopeless = rest[k] > total_free or (bool(failed) and state(k) in failed)
        return [[] if hopeless else options(k), None]  # options left, destination

    path = [node(0)]
    steps = 0
    while path:
        k = len(path) - 1
        left, dst = path[-1]
        if dst is not None:  # undo the option just tried
            free[dst] += sizes[k]
            total_free += sizes[k]
        if not left:
            failed.add(state(k))  # every option undone: free is as it was on entering k
            path.pop()
            continue
        dst = left.pop()
        path[-1][1] = dst
        free[dst] -= sizes[k]
        total_free -= sizes[k]
        if k + 1 == n:
            return [entry[1] for entry in path]
        steps += 1
        if steps > n + _MAX_BACKTRACK_STEPS:
            raise _SearchExhausted
        path.append(node(k + 1))
    return None


def drain_figures(snapshot: DrainSnapshot, inst_id: int) -> DrainFigures:
    """What is left on ``inst_id``; raises UnknownInstance when it is not in the snapshot and
    ValueError for an inconsistent snapshot."""
    by_id = _instances_by_id(snapshot)
    if inst_id not in by_id:
        raise UnknownInstance(f"unknown instance {inst_id} (no recent heartbeat)")
    own = {e.req_id for e in snapshot.entries if e.home_inst_id == inst_id}
    on_it = sum(e.num_blocks for e in snapshot.entries if e.inst_id == inst_id and e.home_inst_id != inst_id)
    return DrainFigures(by_id[inst_id].num_running, len(own), by_id[inst_id].num_blocks_lent, on_it)


def _instances_by_id(snapshot: DrainSnapshot) -> dict[int, DrainInstance]:
    """The snapshot's instances by id; ValueError for an instance listed twice (which of its
    figures hold, and whether it may take blocks, would be a guess) or a negative count."""
    by_id: dict[int, DrainInstance] = {}
    for inst in snapshot.instances:
        if inst.inst_id in by_id:
            raise ValueError(f"instance {inst.inst_id} is listed twice in the drain snapshot")
        for name in ("num_blocks_free", "num_blocks_lent", "num_running"):
            if getattr(inst, name) < 0:
                raise ValueError(f"instance {inst.inst_id} reports {name} = {getattr(inst, name)} (negative)")
        by_id[inst.inst_id] = inst
    return by_id
