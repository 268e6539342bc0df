"""The gManager's soft state, without I/O: heartbeats in, acks, snapshots and hints out."""

from __future__ import annotations

import pytest

from infinite_llm.scheduler.election import LocalElection
from infinite_llm.scheduler.gmanager import ClusterView, GManager, GManagerConfig, HeartbeatRefused, role_of
from infinite_llm.scheduler.perf_model import load_model
from infinite_llm.scheduler.policy import RequestPlacementEntry as PolicyEntry
from infinite_llm.transport.messages import CreditorHint, PlacementKey, PoolFigures
from gmanager_testlib import PERF_MODEL, heartbeat


def test_full_then_diff_then_gap() -> None:
    view = ClusterView(silent_after_s=5.0)
    out = view.receive(heartbeat(1, 1, 40, 20, 2, 0, 1, upserts=((7, 1, 12), (8, 1, 8))), now_s=0.0)
    assert (out.acked_placement_version, out.needs_full_placement) == (1, False)
    out = view.receive(heartbeat(1, 2, 40, 28, 1, 1, 2, upserts=((7, 1, 12),), removals=((8, 1),)), now_s=1.0)
    assert (out.acked_placement_version, out.needs_full_placement) == (2, False)
    assert set(view.records[1].placement.entries) == {PlacementKey(7, 1)}
    # A diff from version 3 while 2 is held: the figures are taken, the placement is asked again.
    out = view.receive(heartbeat(1, 3, 40, 30, 1, 3, 4, upserts=((7, 1, 10),)), now_s=2.0)
    assert (out.acked_placement_version, out.needs_full_placement) == (2, True)
    assert view.records[1].pool.num_blocks_free == 30 and view.num_gaps == 1
    out = view.receive(heartbeat(1, 4, 40, 30, 1, 0, 5, upserts=((7, 1, 10),)), now_s=3.0)
    assert (out.acked_placement_version, out.needs_full_placement) == (5, False)
    [entry] = view.records[1].placement.entries.values()
    assert (entry.req_id, entry.inst_id, entry.num_blocks, entry.local) == (7, 1, 10, True)


def test_a_diff_with_no_base_held_asks_for_the_full_placement() -> None:
    view = ClusterView(silent_after_s=5.0)  # a new leader: nothing held
    out = view.receive(heartbeat(3, 50, 40, 40, 0, 9, 10), now_s=0.0)
    assert (out.acked_placement_version, out.needs_full_placement) == (0, True)


@pytest.mark.parametrize("bad", [
    heartbeat(1, 1, 40, 41, 0, 0, 1),  # more free blocks than the pool
    heartbeat(1, 1, 40, 30, 0, 0, 1, lent=20),  # free + lent beyond the pool
    heartbeat(1, 1, 40, 30, -1, 0, 1),  # negative batch
    heartbeat(0, 1, 40, 30, 0, 0, 1),  # no such instance id
    heartbeat(1, 1, 40, 30, 1, 0, 1, upserts=((7, 1, 0),)),  # an empty entry
    heartbeat(1, 1, 40, 30, 1, 0, 1, upserts=((7, 1, 11),)),  # more local blocks than in use
])
def test_impossible_heartbeats_are_refused_counted_and_not_kept(bad) -> None:
    view = ClusterView(silent_after_s=5.0)
    with pytest.raises(HeartbeatRefused):
        view.receive(bad, now_s=0.0)
    assert view.num_refused == 1 and view.records == {}


def test_a_replayed_heartbeat_is_refused_but_a_restart_is_taken() -> None:
    view = ClusterView(silent_after_s=5.0)
    view.receive(heartbeat(1, 5, 40, 40, 0, 0, 1), now_s=0.0)
    with pytest.raises(HeartbeatRefused):
        view.receive(heartbeat(1, 5, 40, 40, 0, 1, 2), now_s=0.1)
    # The instance restarted: numbering from 1 again, with its full placement.
    assert view.receive(heartbeat(1, 1, 40, 40, 0, 0, 1), now_s=0.2).acked_placement_version == 1


def test_snapshot_hints_and_silence() -> None:
    view = ClusterView(silent_after_s=3.0)
    view.receive(heartbeat(1, 1, 40, 20, 1, 0, 1, upserts=((7, 1, 16), (7, 2, 4)), borrowed=4), now_s=0.0)
    view.receive(heartbeat(2, 1, 40, 30, 1, 0, 1, upserts=((9, 2, 6),), lent=4), now_s=0.0)
    view.receive(heartbeat(3, 1, 40, 35, 0, 0, 1), now_s=2.0)
    snapshot, requests = view.snapshot(now_s=2.5, block_size=16)
    assert [i.inst_id for i in snapshot.instances] == [1, 2, 3]
    # The policy sees requests by index: ids are unique per home only.
    assert requests == [(1, 7), (2, 9)]
    assert sorted(snapshot.placement.entries(), key=lambda e: (e.req_id, e.inst_id)) == [
        PolicyEntry(0, 1, 16, True), PolicyEntry(0, 2, 4, False), PolicyEntry(1, 2, 6, True)]
    assert view.creditor_hints(now_s=2.5, exclude_inst_id=2, num_hints=2) == (CreditorHint(3, 35), CreditorHint(1, 20))
    # Instances 1 and 2 fall silent: they leave the snapshot, and instance 3 no longer sees
    # its own placement's blocks on them (none here) nor them as creditors.
    snapshot, requests = view.snapshot(now_s=4.0, block_size=16)
    assert [i.inst_id for i in snapshot.instances] == [3] and len(snapshot.placement) == 0 and requests == []
    assert view.creditor_hints(now_s=4.0, exclude_inst_id=3, num_hints=2) == ()
    assert view.forget_silent(now_s=4.0) == [1, 2] and set(view.records) == {3}


def test_two_homes_may_use_the_same_request_id() -> None:
    view = ClusterView(silent_after_s=3.0)
    view.receive(heartbeat(1, 1, 40, 20, 1, 0, 1, upserts=((1, 1, 20),)), now_s=0.0)
    view.receive(heartbeat(2, 1, 40, 30, 1, 0, 1, upserts=((1, 2, 10),)), now_s=0.0)
    snapshot, requests = view.snapshot(now_s=0.0, block_size=16)
    assert requests == [(1, 1), (2, 1)]
    assert sorted((e.req_id, e.inst_id) for e in snapshot.placement.entries()) == [(0, 1), (1, 2)]


def test_no_plan_from_figures_older_than_the_last_moves(tmp_path) -> None:
    now = [0.0]
    gmanager = GManager(GManagerConfig(state_dir=tmp_path, perf_model_path=PERF_MODEL), load_model(PERF_MODEL),
                        LocalElection(tmp_path), clock=lambda: now[0])
    gmanager.view.receive(heartbeat(1, 1, 40, 20, 1, 0, 1, upserts=((7, 1, 20),)), now_s=0.0)
    gmanager.view.receive(heartbeat(2, 1, 40, 40, 0, 0, 1), now_s=0.0)
    assert gmanager.moves_settled()
    gmanager._moved_at_s = {1: 1.0, 2: 1.0}  # a round moved blocks from 1 to 2 at t = 1 s
    now[0] = 2.0
    assert not gmanager.moves_settled()
    gmanager.view.receive(heartbeat(1, 2, 40, 30, 1, 1, 2, upserts=((7, 1, 10),)), now_s=2.0)
    assert not gmanager.moves_settled()  # instance 2 has not spoken since
    gmanager.view.receive(heartbeat(2, 2, 40, 30, 0, 1, 2), now_s=2.5)
    assert gmanager.moves_settled()


def test_roles() -> None:
    assert role_of(PoolFigures(40, 10, 0, 5)) == "debtor"
    assert role_of(PoolFigures(40, 10, 5, 0)) == "creditor"
    assert role_of(PoolFigures(40, 10, 5, 5)) == "debtor+creditor"
    assert role_of(PoolFigures(40, 10, 0, 0)) == "none"
