"""The drain planner on hand-made snapshots: exact moves, refusals, unknown instances."""

from __future__ import annotations

import itertools
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infinite_llm.scheduler import drain
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


# Instance 0 holds 15 blocks for instance 9 (requests 1-4: 5, 4, 3 and 3 blocks); 1 has 9 free,
# 2 has 6. Largest first on the most free (or on the best fit) leaves the last 3 nowhere; 5 + 4
# on 1 and 3 + 3 on 2 fit exactly.
EXACT_FIT = snapshot(
    [instance(0, 0, lent=15), instance(1, 9), instance(2, 6), instance(9, 0, running=4)],
    [(9, 1, 0, 5), (9, 2, 0, 4), (9, 3, 0, 3), (9, 4, 0, 3)],
)
EXACT_FIT_MOVES = (DrainMove(9, 1, 0, 1, 5), DrainMove(9, 2, 0, 1, 4), DrainMove(9, 3, 0, 2, 3),
                   DrainMove(9, 4, 0, 2, 3))


def test_a_drain_that_fits_only_by_backtracking_is_planned_the_same_from_any_order():
    plan = plan_drain(EXACT_FIT, 0)
    assert plan.moves == EXACT_FIT_MOVES
    assert (plan.num_blocks_held, plan.num_blocks_own_movable, plan.num_blocks_free_elsewhere) == (15, 0, 15)
    rng = random.Random(0)
    for _ in range(10):
        instances, entries = list(EXACT_FIT.instances), list(EXACT_FIT.entries)
        rng.shuffle(instances)
        rng.shuffle(entries)
        assert plan_drain(DrainSnapshot(tuple(instances), tuple(entries)), 0) == plan


def test_refused_when_each_request_fits_alone_but_no_placement_holds_them_all():
    # 10 blocks in all and 10 free, but the two 4-block segments each take one instance and
    # leave 1 block on each for the 2-block segment.
    snap = snapshot([instance(0, 0, lent=10), instance(1, 5), instance(2, 5), instance(9, 0, running=3)],
                    [(9, 1, 0, 4), (9, 2, 0, 4), (9, 3, 0, 2)])
    with pytest.raises(DrainRefused, match="10 free blocks, but in no placement does each request's blocks fit"):
        plan_drain(snap, 0)


def test_a_search_out_of_steps_says_a_placement_may_exist(monkeypatch):
    monkeypatch.setattr(drain, "_MAX_BACKTRACK_STEPS", 0)
    with pytest.raises(DrainRefused, match="within 0 steps of backtracking; one may exist"):
        plan_drain(EXACT_FIT, 0)
    # Best fit needs no backtracking: one step per request is always allowed.
    assert plan_drain(CLUSTER, 2).moves == (DrainMove(1, 7, 2, 3, 12), DrainMove(2, 5, 2, 3, 9))


@pytest.mark.parametrize("field", ["num_blocks_free", "num_blocks_lent", "num_running"])
def test_a_negative_count_is_refused_as_a_bad_snapshot(field):
    figures = dict(num_blocks_free=10, num_blocks_lent=0, num_running=0, draining=False)
    bad = DrainInstance(2, **{**figures, field: -8})
    snap = DrainSnapshot((instance(0, 0, running=1), instance(1, 10), bad), (DrainEntry(0, 1, 0, 3),))
    for call in (plan_drain, drain_figures):
        with pytest.raises(ValueError, match=f"instance 2 reports {field} = -8") as err:
            call(snap, 0)
        assert not isinstance(err.value, DrainRefused)  # a bad snapshot, not a lack of room


def test_an_instance_listed_twice_is_refused_as_a_bad_snapshot():
    # Listed live with 10 free and draining: its blocks could otherwise go to a draining instance.
    snap = snapshot([instance(0, 0, running=1), instance(1, 10), instance(1, 0, draining=True)], [(0, 1, 0, 3)])
    for call in (plan_drain, drain_figures):
        with pytest.raises(ValueError, match="instance 1 is listed twice") as err:
            call(snap, 0)
        assert not isinstance(err.value, DrainRefused)


@st.composite
def small_snapshots(draw) -> DrainSnapshot:
    """Instance 0 is drained; 1-4 may be draining; homes 0-5 (5 is not live)."""
    num = draw(st.integers(2, 5))
    instances = [instance(i, draw(st.integers(0, 12)), 0, draw(st.integers(0, 3)), i > 0 and draw(st.booleans()))
                 for i in range(num)]
    holders = st.sampled_from([0, 0, 0, *range(1, num)])  # mostly on the drained instance
    entries = [(draw(st.integers(0, 5)), draw(st.integers(0, 7)), draw(holders), draw(st.integers(0, 8)))
               for _ in range(draw(st.integers(0, 7)))]
    return snapshot(instances, entries)


def _requests_on(snap: DrainSnapshot, inst_id: int, own_blocks: bool) -> dict[tuple[int, int], int]:
    """(home, req) -> blocks that must leave ``inst_id``, as the module docstring defines them."""
    live = {i.inst_id for i in snap.instances}
    wanted: dict[tuple[int, int], int] = {}
    for e in snap.entries:
        if e.inst_id == inst_id and e.num_blocks > 0 and e.home_inst_id in live:
            wanted[(e.home_inst_id, e.req_id)] = wanted.get((e.home_inst_id, e.req_id), 0) + e.num_blocks
    return {(home, req): n - 1 if home == inst_id else n for (home, req), n in wanted.items()
            if home != inst_id or (own_blocks and n > 1)}


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(small_snapshots(), st.booleans())
def test_plans_keep_every_guarantee_and_refusals_mean_no_placement_exists(snap, own_blocks):
    by_id = {i.inst_id: i for i in snap.instances}
    wanted = _requests_on(snap, 0, own_blocks)
    allowed = {key: [i for i, inst in by_id.items() if i not in (0, key[0]) and not inst.draining] for key in wanted}
    try:
        plan = plan_drain(snap, 0, own_blocks)
    except DrainRefused:
        # Refused: no assignment of each request to one allowed instance fits the free blocks.
        for dsts in itertools.product(*allowed.values()):
            used: dict[int, int] = {}
            for (key, n), dst in zip(wanted.items(), dsts):
                used[dst] = used.get(dst, 0) + n
            assert any(u > by_id[i].num_blocks_free for i, u in used.items()), dict(zip(wanted, dsts))
        return
    assert {(m.home_inst_id, m.req_id): m.num_blocks for m in plan.moves} == wanted
    assert len(plan.moves) == len(wanted)
    used = {}
    for m in plan.moves:
        assert m.src_inst_id == 0 and m.dst_inst_id in allowed[(m.home_inst_id, m.req_id)]
        used[m.dst_inst_id] = used.get(m.dst_inst_id, 0) + m.num_blocks
    assert all(u <= by_id[i].num_blocks_free for i, u in used.items())
    # Held segments first, each kind largest first.
    order = [(m.kind == "own", -m.num_blocks, m.home_inst_id, m.req_id) for m in plan.moves]
    assert order == sorted(order)
    # The same plan from the snapshot in reverse order.
    assert plan_drain(DrainSnapshot(snap.instances[::-1], snap.entries[::-1]), 0, own_blocks) == plan
