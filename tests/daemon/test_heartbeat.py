from infinite_llm.daemon.heartbeat import HeartbeatState
from infinite_llm.transport.messages import HeartbeatReply, PlacementKey, PoolFigures, RequestPlacementEntry
from infinite_llm.transport.placement import VersionedPlacement, apply_heartbeat

POOL = PoolFigures(100, 40, 5, 7)


def entry(req, inst, blocks, local):
    return RequestPlacementEntry(req, inst, blocks, local)


def test_full_then_diffs_then_full_again_after_a_gap():
    state = HeartbeatState(inst_id=1)
    held = VersionedPlacement(0, {})
    first = state.next(POOL, 2, [entry(7, 1, 10, True), entry(7, 2, 4, False)])
    assert (first.placement_base_version, first.placement_version, first.seq) == (0, 1, 1)
    assert first.placement_upserts == (entry(7, 1, 10, True), entry(7, 2, 4, False))
    held = apply_heartbeat(held, first)
    state.on_reply(HeartbeatReply(epoch=3, acked_placement_version=1, needs_full_placement=False, creditors=()))

    second = state.next(POOL, 2, [entry(7, 1, 11, True), entry(9, 1, 2, True)])
    assert second.placement_base_version == 1
    assert second.placement_upserts == (entry(7, 1, 11, True), entry(9, 1, 2, True))
    assert second.placement_removals == (PlacementKey(7, 2),)
    held = apply_heartbeat(held, second)
    assert held.entries == {PlacementKey(7, 1): entry(7, 1, 11, True), PlacementKey(9, 1): entry(9, 1, 2, True)}

    # The reply to the second heartbeat was lost; the third still diffs against version 1.
    third = state.next(POOL, 1, [entry(9, 1, 3, True)])
    assert third.placement_base_version == 1
    state.on_reply(HeartbeatReply(epoch=4, acked_placement_version=0, needs_full_placement=True, creditors=()))
    fourth = state.next(POOL, 1, [entry(9, 1, 3, True)])
    assert fourth.placement_base_version == 0 and fourth.placement_upserts == (entry(9, 1, 3, True),)
    assert fourth.placement_removals == ()
