"""Draining an instance: which blocks leave it and where they go (pure: no clock, no I/O).

A drain empties instance D so that it may stop:

* every segment D holds for another home H moves to a live, non-draining instance other than
  D and H (a creditor-to-creditor move, carried out by H: ``MoveKV(src=D, dst=X)`` to H);
* the full blocks of D's own requests move off D too (home moves, ``MoveKV(home=D, src=D,
  dst=X)`` to D): D's requests still finish on D, whose clients are connected to D, but their KV stops
  taking D's memory. The newest block of each stays, as new tokens are written into it.

:func:`plan_drain` takes a :class:`DrainSnapshot` built from heartbeats and returns a
:class:`DrainPlan`, or raises :class:`UnknownInstance` or :class:`DrainRefused` (the cluster
lacks room: nothing may be sent). :func:`drain_figures` says from the same snapshot whether D
is safe to stop. The gManager sends the plan and plans again from newer heartbeats until
nothing is left on D.
"""

from __future__ import annotations

from dataclasses import dataclass


class UnknownInstance(LookupError):
    """The instance to drain is not live (no recent heartbeat)."""


class DrainRefused(ValueError):
    """The other instances lack room for what the instance holds; nothing was planned."""


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

    Each request's blocks on the drained instance go to one destination: the live,
    non-draining instance with the most free blocks left (ties: the lower id), never the
    request's home for a held segment (a home does not take blocks back on command). Moves are
    placed largest first. Raises UnknownInstance for an instance not in the snapshot and
    DrainRefused when some request's blocks fit nowhere.
    """
    by_id = {i.inst_id: i for i in snapshot.instances}
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

    moves: list[DrainMove] = []
    wanted = [((home, req), n) for (home, req), n in held.items()]
    wanted += [((inst_id, req), n) for req, n in own_movable.items()]
    # Held segments first (the drain cannot end without them), each group largest first.
    wanted.sort(key=lambda w: (w[0][0] == inst_id, -w[1], w[0]))
    for (home, req), num_blocks in wanted:
        candidates = [i for i in free if i != home and free[i] >= num_blocks]
        if not candidates:
            raise DrainRefused(
                f"request {req} of instance {home} has {num_blocks} blocks on instance {inst_id} and no other "
                f"live instance{'' if home == inst_id else ' than its home'} has that many free "
                f"(most free: {max((free[i] for i in free if i != home), default=0)})")
        dst = min(candidates, key=lambda i: (-free[i], i))
        free[dst] -= num_blocks
        moves.append(DrainMove(home, req, inst_id, dst, num_blocks))
    return DrainPlan(inst_id, tuple(moves), num_held, num_own, free_elsewhere)


def drain_figures(snapshot: DrainSnapshot, inst_id: int) -> DrainFigures:
    """What is left on ``inst_id``; raises UnknownInstance when it is not in the snapshot."""
    by_id = {i.inst_id: i for i in snapshot.instances}
    if inst_id not in by_id:
        raise UnknownInstance(f"unknown instance {inst_id} (no recent heartbeat)")
    own = {e.req_id for e in snapshot.entries if e.home_inst_id == inst_id}
    on_it = sum(e.num_blocks for e in snapshot.entries if e.inst_id == inst_id and e.home_inst_id != inst_id)
    return DrainFigures(by_id[inst_id].num_running, len(own), by_id[inst_id].num_blocks_lent, on_it)
