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


def test_unanswered_heartbeats_keep_only_the_last_placement_sent():
    """Replies stop coming (a hung leader, or replies refused by the epoch fence): one
    heartbeat is in flight at a time, so only the last one sent can still be acknowledged."""
    state = HeartbeatState(inst_id=1)
    held = VersionedPlacement(0, {})
    first = state.next(POOL, 1, [entry(7, 1, 10, True)])
    held = apply_heartbeat(held, first)
    state.on_reply(HeartbeatReply(epoch=3, acked_placement_version=1, needs_full_placement=False, creditors=()))
    for blocks in range(11, 111):
        last = state.next(POOL, 1, [entry(7, 1, blocks, True)])
    assert len(state._sent) == 1
    assert last.placement_base_version == 1 and last.placement_upserts == (entry(7, 1, 110, True),)
    # The leader takes the last one and answers: the next diff is against it.
    held = apply_heartbeat(held, last)
    state.on_reply(HeartbeatReply(epoch=3, acked_placement_version=101, needs_full_placement=False, creditors=()))
    following = state.next(POOL, 1, [entry(7, 1, 111, True)])
    assert following.placement_base_version == 101
    assert apply_heartbeat(held, following).entries == {PlacementKey(7, 1): entry(7, 1, 111, True)}
    # A late reply for a heartbeat older than the last one sent changes nothing.
    state.on_reply(HeartbeatReply(epoch=3, acked_placement_version=50, needs_full_placement=False, creditors=()))
    assert state.acked_version == 101
