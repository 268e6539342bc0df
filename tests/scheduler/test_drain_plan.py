"""The drain planner on hand-made snapshots: exact moves, refusals, unknown instances."""

from __future__ import annotations

import pytest

from infinite_llm.scheduler.drain import (
    DrainEntry,
    DrainFigures,
    DrainInstance,
    DrainMove,
    DrainRefused,
    DrainSnapshot,
    UnknownInstance,
    drain_figures,
    plan_drain,
)


def instance(inst_id: int, free: int, lent: int = 0, running: int = 0, draining: bool = False) -> DrainInstance:
    return DrainInstance(inst_id, free, lent, running, draining)


def snapshot(instances, entries) -> DrainSnapshot:
    return DrainSnapshot(tuple(instances), tuple(DrainEntry(*e) for e in entries))


# Instance 1 runs request 7 (40 blocks at home, 12 on 2, 9 on 3); instance 2 runs request 5
# (10 blocks at home). Entries: (home, req, holder, blocks).
CLUSTER = snapshot(
    [instance(1, 0, running=1), instance(2, 18, lent=12, running=1), instance(3, 40, lent=9)],
    [(1, 7, 1, 40), (1, 7, 2, 12), (1, 7, 3, 9), (2, 5, 2, 10)],
)


def test_drain_moves_held_segments_past_their_home_and_own_full_blocks():
    plan = plan_drain(CLUSTER, 2)
    # Request 7's segment may not go home to 1: it goes to 3; request 5's 9 full blocks go to 3 too.
    assert plan.moves == (DrainMove(1, 7, 2, 3, 12), DrainMove(2, 5, 2, 3, 9))
    assert [m.kind for m in plan.moves] == ["held", "own"]
    assert (plan.num_blocks_held, plan.num_blocks_own_movable, plan.num_blocks_free_elsewhere) == (12, 9, 40)


def test_destinations_are_the_most_free_with_ties_to_the_lower_id():
    snap = snapshot(
        [instance(1, 10), instance(2, 10), instance(3, 0), instance(4, 6)],
        [(3, 1, 3, 5), (3, 2, 3, 7), (4, 9, 3, 4)],
    )
    plan = plan_drain(snap, 3)
    # Held first (4's request: most free is 1), then own requests largest first: 2 then 1.
    assert plan.moves == (DrainMove(4, 9, 3, 1, 4), DrainMove(3, 2, 3, 2, 6), DrainMove(3, 1, 3, 1, 4))


def test_a_draining_instance_takes_nothing_and_a_one_block_request_stays():
    snap = snapshot(
        [instance(1, 50, draining=True), instance(2, 0), instance(3, 8)],
        [(2, 1, 2, 1), (2, 2, 2, 6)],
    )
    assert plan_drain(snap, 2).moves == (DrainMove(2, 2, 2, 3, 5),)


def test_a_creditor_drains_away_from_the_home_and_an_empty_one_needs_no_move():
    plan = plan_drain(CLUSTER, 3)
    # Instance 3 holds request 7's 9 blocks: they go to 2 (1 is the home, and full anyway).
    assert plan.moves == (DrainMove(1, 7, 3, 2, 9),)
    empty = snapshot([instance(1, 5), instance(2, 5)], [])
    assert plan_drain(empty, 2).moves == ()


def test_refused_when_the_cluster_lacks_room_in_all():
    snap = snapshot([instance(1, 0, running=1), instance(2, 10, lent=20), instance(3, 5)],
                    [(1, 7, 1, 30), (1, 7, 2, 20)])
    with pytest.raises(DrainRefused, match="holds 20 blocks for other instances .* only 5 free blocks"):
        plan_drain(snap, 2)


def test_refused_when_one_request_fits_nowhere_but_its_home():
    # 3 has room in all, but request 7's 12 blocks may go only to 3, which has 10.
    snap = snapshot([instance(1, 30), instance(2, 0, lent=12), instance(3, 10)],
                    [(1, 7, 1, 4), (1, 7, 2, 12)])
    with pytest.raises(DrainRefused, match="request 7 of instance 1 has 12 blocks on instance 2 .* than its home"):
        plan_drain(snap, 2)


def test_unknown_instance():
    with pytest.raises(UnknownInstance, match="unknown instance 9"):
        plan_drain(CLUSTER, 9)
    with pytest.raises(UnknownInstance):
        drain_figures(CLUSTER, 9)


def test_figures_say_safe_to_stop_only_when_nothing_is_left():
    assert drain_figures(CLUSTER, 2) == DrainFigures(num_running=1, num_own_requests=1, num_blocks_held=12,
                                                     num_blocks_on_it=12)
    assert not drain_figures(CLUSTER, 2).safe_to_stop
    done = snapshot([instance(1, 0, running=1), instance(2, 40), instance(3, 19, lent=21)],
                    [(1, 7, 1, 40), (1, 7, 3, 21)])
    assert drain_figures(done, 2).safe_to_stop
    # A reservation for another home still counts, as does a request that waits.
    assert not drain_figures(snapshot([instance(2, 38, lent=2)], []), 2).safe_to_stop
    assert not drain_figures(snapshot([instance(2, 38)], [(2, 4, 2, 2)]), 2).safe_to_stop


def test_a_stopping_instance_hands_over_only_what_it_holds_for_others():
    plan = plan_drain(CLUSTER, 2, own_blocks=False)
    assert plan.moves == (DrainMove(1, 7, 2, 3, 12),)
    assert (plan.num_blocks_held, plan.num_blocks_own_movable) == (12, 0)
    # Room for the held segment alone is enough: its own blocks need none.
    tight = snapshot([instance(1, 0, running=1), instance(2, 0, lent=12, running=1), instance(3, 12, lent=9)],
                     [(1, 7, 1, 40), (1, 7, 2, 12), (1, 7, 3, 9), (2, 5, 2, 10)])
    with pytest.raises(DrainRefused):
        plan_drain(tight, 2)
    assert plan_drain(tight, 2, own_blocks=False).moves == (DrainMove(1, 7, 2, 3, 12),)
