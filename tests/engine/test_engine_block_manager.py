"""Block accounting on tiny pools, with exact block ids."""

import pytest

from infinite_llm.engine.block_manager import BlockManager, OutOfBlocks, Segment


def test_allocate_grows_the_home_tail_with_lowest_ids():
    bm = BlockManager(block_size=4, pool_blocks=[8, 4])
    assert bm.can_allocate("a", 6)
    bm.allocate("a", 6)
    assert bm.block_table("a") == (Segment(0, (0, 1), 0, 6),)
    bm.allocate("b", 3)
    bm.allocate("a", 9)  # one more block for tokens 8..9
    assert bm.block_table("a") == (Segment(0, (0, 1, 3), 0, 9),)
    assert bm.block_table("b") == (Segment(0, (2,), 0, 3),)
    assert bm.slot_mapping("a", 6, 9) == [1 * 4 + 2, 1 * 4 + 3, 3 * 4 + 0]
    assert bm.num_free_blocks(0) == 4


def test_can_allocate_refuses_without_changing_anything():
    bm = BlockManager(block_size=4, pool_blocks=[2])
    bm.allocate("a", 8)
    assert not bm.can_allocate("b", 1)
    with pytest.raises(OutOfBlocks, match="instance 0 has 0 free blocks, 1 were asked for"):
        bm.allocate("b", 1)
    assert bm.block_table("a") == (Segment(0, (0, 1), 0, 8),)
    assert not bm.has_request("b") or bm.block_table("b") == ()


def test_free_returns_blocks_on_every_instance():
    bm = BlockManager(block_size=4, pool_blocks=[4, 4])
    bm.allocate("a", 12)
    move = bm.lend("a", 2, 1, num_written=12)
    bm.commit_move(move)
    assert bm.num_free_blocks(0) == 3 and bm.num_free_blocks(1) == 2
    bm.free("a")
    assert bm.num_free_blocks(0) == 4 and bm.num_free_blocks(1) == 4
    assert bm.block_table("a") == ()


def test_lend_moves_the_oldest_full_blocks_and_commit_switches_the_table():
    bm = BlockManager(block_size=4, pool_blocks=[6, 3, 3])
    bm.allocate("a", 14)  # blocks 0..3, the last one half full
    assert bm.num_lendable_blocks("a", num_written=14) == 3
    assert bm.num_lendable_blocks("a", num_written=7) == 1  # only fully written blocks move
    move = bm.lend("a", 2, 2, num_written=14)
    assert (move.src_block_ids, move.dst_block_ids, move.token_start, move.num_tokens) == ((0, 1), (0, 1), 0, 8)
    assert bm.block_table("a") == (Segment(0, (0, 1, 2, 3), 0, 14),)  # unchanged until committed
    bm.commit_move(move)
    assert bm.block_table("a") == (Segment(2, (0, 1), 0, 8), Segment(0, (2, 3), 8, 6))
    assert bm.num_free_blocks(0) == 4
    bm.commit_move(bm.lend("a", 1, 1, num_written=14))
    assert bm.block_table("a") == (Segment(2, (0, 1), 0, 8), Segment(1, (0,), 8, 4), Segment(0, (3,), 12, 2))


def test_consecutive_lends_to_one_instance_coalesce():
    bm = BlockManager(block_size=2, pool_blocks=[8, 8])
    bm.allocate("a", 10)
    bm.commit_move(bm.lend("a", 1, 1, num_written=10))
    bm.commit_move(bm.lend("a", 2, 1, num_written=10))
    assert bm.block_table("a") == (Segment(1, (0, 1, 2), 0, 6), Segment(0, (3, 4), 6, 4))


def test_lending_every_home_block_opens_a_new_home_segment():
    bm = BlockManager(block_size=4, pool_blocks=[4, 4])
    bm.allocate("a", 8)
    bm.commit_move(bm.lend("a", 2, 1, num_written=8))
    assert bm.block_table("a") == (Segment(1, (0, 1), 0, 8),)
    bm.allocate("a", 9)
    assert bm.block_table("a") == (Segment(1, (0, 1), 0, 8), Segment(0, (0,), 8, 1))
    assert bm.slot_mapping("a", 8, 9) == [0]


def test_take_back_returns_a_segment_home_and_coalesces():
    bm = BlockManager(block_size=4, pool_blocks=[6, 4])
    bm.allocate("a", 10)
    bm.commit_move(bm.lend("a", 2, 1, num_written=10))
    move = bm.take_back("a", 0)
    assert (move.src_instance_id, move.src_block_ids, move.dst_instance_id, move.dst_block_ids) == (1, (0, 1), 0, (0, 1))
    bm.commit_move(move)
    assert bm.block_table("a") == (Segment(0, (0, 1, 2), 0, 10),)
    assert bm.num_free_blocks(1) == 4


def test_abort_move_releases_the_reservation():
    bm = BlockManager(block_size=4, pool_blocks=[4, 2])
    bm.allocate("a", 8)
    move = bm.lend("a", 2, 1, num_written=8)
    assert bm.num_free_blocks(1) == 0
    assert not bm.can_lend("a", 1, 1, num_written=8)  # a pending move blocks another
    bm.abort_move(move)
    assert bm.num_free_blocks(1) == 2
    assert bm.block_table("a") == (Segment(0, (0, 1), 0, 8),)
    with pytest.raises(ValueError, match="not pending"):
        bm.commit_move(move)


def test_lend_refuses_bad_requests():
    bm = BlockManager(block_size=4, pool_blocks=[4, 1])
    bm.allocate("a", 8)
    with pytest.raises(OutOfBlocks, match="cannot lend 2 blocks to instance 1"):
        bm.lend("a", 2, 1, num_written=8)
    with pytest.raises(OutOfBlocks):
        bm.lend("a", 1, 0, num_written=8)  # the home cannot lend to itself
    with pytest.raises(ValueError, match="already on the home instance"):
        bm.take_back("a", 0)


def test_slot_mapping_refuses_positions_outside_a_home_segment():
    bm = BlockManager(block_size=4, pool_blocks=[4, 4])
    bm.allocate("a", 8)
    bm.commit_move(bm.lend("a", 1, 1, num_written=8))
    with pytest.raises(ValueError, match=r"positions \[0, 2\) are not in one home segment \(\[0, 4\) is on instance 1\)"):
        bm.slot_mapping("a", 0, 2)
    with pytest.raises(ValueError, match=r"positions \[2, 6\) are not in one home segment"):
        bm.slot_mapping("a", 2, 6)
    assert len(bm.slot_mapping("a", 4, 8)) == 4


def test_plan_spill_takes_the_largest_lenders_first():
    bm = BlockManager(block_size=4, pool_blocks=[10, 2, 3])
    bm.allocate("a", 8)
    bm.allocate("b", 20)
    plan = bm.plan_spill(4, {"a": 8, "b": 20})
    assert plan == [("b", 3, 2), ("b", 1, 1)]
    plan = bm.plan_spill(7, {"a": 8, "b": 20})
    assert plan == [("b", 3, 2), ("b", 2, 1)]  # the creditors are full before "a"'s turn
    assert bm.plan_spill(4, {"a": 0, "b": 0}) == []


def test_relocate_remote_points_a_peer_segment_at_another_peer():
    # One pool in this process (0); peers 1 and 2 are other daemons' pools.
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("a", 20)  # home blocks 0..4
    bm.commit_move(bm.lend_to_remote("a", 1, (10, 11), num_written=20, copy_id=1))
    bm.commit_move(bm.lend_to_remote("a", 1, (12,), num_written=20, copy_id=2))
    assert bm.block_table("a") == (Segment(1, (10, 11), 0, 8, 1), Segment(1, (12,), 8, 4, 2), Segment(0, (3, 4), 12, 8))
    moved = bm.relocate_remote("a", 8, src_instance_id=1, dst_instance_id=2, dst_block_ids=(30,), copy_id=3,
                               src_copy_id=2)
    assert moved == Segment(2, (30,), 8, 4, 3)
    assert bm.block_table("a") == (Segment(1, (10, 11), 0, 8, 1), Segment(2, (30,), 8, 4, 3), Segment(0, (3, 4), 12, 8))
    # Peer segments stay apart even when they become neighbours on one peer.
    bm.relocate_remote("a", 0, 1, 2, (31, 32), copy_id=4, src_copy_id=1)
    assert bm.block_table("a") == (Segment(2, (31, 32), 0, 8, 4), Segment(2, (30,), 8, 4, 3), Segment(0, (3, 4), 12, 8))
    assert bm.num_free_blocks(0) == 6  # no block of this process changed hands


def test_relocate_remote_refuses_what_does_not_match():
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("a", 12)
    bm.commit_move(bm.lend_to_remote("a", 1, (10, 11), num_written=12, copy_id=1))
    before = bm.block_table("a")
    with pytest.raises(ValueError, match="no segment at token 4"):
        bm.relocate_remote("a", 4, 1, 2, (5,), copy_id=2, src_copy_id=1)
    with pytest.raises(ValueError, match="no segment at token 0 on instance 3"):
        bm.relocate_remote("a", 0, 3, 2, (5, 6), copy_id=2, src_copy_id=1)
    with pytest.raises(ValueError, match="1 blocks for a segment of 2"):
        bm.relocate_remote("a", 0, 1, 2, (5,), copy_id=2, src_copy_id=1)
    with pytest.raises(ValueError, match="must both be peers"):
        bm.relocate_remote("a", 0, 1, 0, (5, 6), copy_id=2, src_copy_id=1)
    with pytest.raises(KeyError):
        bm.relocate_remote("b", 0, 1, 2, (5, 6), copy_id=2, src_copy_id=1)
    assert bm.block_table("a") == before


def test_relocate_remote_leaves_another_copy_at_the_moved_segments_place():
    """The request was preempted, prefilled again and spilled to the same peer while a copy of
    its old segment moved on: the new copy sits where the old one did, and is not switched."""
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("a", 12)
    bm.commit_move(bm.lend_to_remote("a", 1, (10, 11), num_written=12, copy_id=1))
    bm.free("a")
    bm.allocate("a", 12)
    bm.commit_move(bm.lend_to_remote("a", 1, (14, 15), num_written=12, copy_id=9))
    before = bm.block_table("a")
    with pytest.raises(ValueError, match="is copy 9 now, not the moved copy 1"):
        bm.relocate_remote("a", 0, 1, 2, (30, 31), copy_id=3, src_copy_id=1)
    assert bm.block_table("a") == before


def test_a_stale_move_leaves_the_pending_one_at_its_place_alone():
    """A move of an earlier life of the request (freed, allocated again, lent again) is refused
    without taking the live move's place: the live one still commits or aborts."""
    bm = BlockManager(block_size=4, pool_blocks=[4, 4])
    bm.allocate("a", 8)
    stale = bm.lend("a", 2, 1, num_written=8)
    bm.free("a")  # aborts the pending move with the request
    bm.allocate("a", 8)
    live = bm.lend("a", 2, 1, num_written=8)
    with pytest.raises(ValueError, match="not pending"):
        bm.commit_move(stale)
    with pytest.raises(ValueError, match="not pending"):
        bm.abort_move(stale)
    bm.abort_move(live)
    assert bm.num_free_blocks(1) == 4 and bm.num_free_blocks(0) == 2


def test_a_move_whose_source_segment_is_gone_is_refused_and_stays_pending():
    """Committing a lend whose source no longer starts the table where it did (a take-back
    joined the home segments meanwhile) raises ValueError, not StopIteration, and the move
    can still be aborted: its destination blocks are not lost."""
    bm = BlockManager(block_size=4, pool_blocks=[6, 4])
    bm.allocate("a", 16)
    bm.commit_move(bm.lend("a", 2, 1, num_written=16))  # tokens 0..7 on instance 1
    back = bm.take_back("a", 0)
    lend = bm.lend("a", 1, 1, num_written=16)  # the home segment at token 8
    bm.commit_move(back)  # joins tokens 0..15 at home: no segment starts at 8 now
    with pytest.raises(ValueError, match="no longer in the table"):
        bm.commit_move(lend)
    free_before = bm.num_free_blocks(1)
    bm.abort_move(lend)
    assert bm.num_free_blocks(1) == free_before + 1


def test_a_request_counts_on_the_peer_segments_its_table_or_a_pending_move_points_at():
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("a", 20)  # home blocks 0..4
    bm.commit_move(bm.lend_to_remote("a", 1, (10, 11), num_written=20, copy_id=41))  # tokens 0..7 on peer 1
    assert bm.block_table("a")[0] == Segment(1, (10, 11), 0, 8, copy_id=41)
    assert bm.counts_on("a", 0, 1, 41)
    assert not bm.counts_on("a", 0, 1, 40)  # another copy of that segment (an older one)
    assert not bm.counts_on("a", 0, 2, 41) and not bm.counts_on("a", 4, 1, 41)  # another peer, not a start
    assert not bm.counts_on("b", 0, 1, 41)  # no such request
    pending = bm.lend_to_remote("a", 2, (20,), num_written=20, copy_id=7)  # tokens 8..11 moving to peer 2
    # Committed there before the table switches: the home counts on that copy already.
    assert bm.counts_on("a", 8, 2, 7) and not bm.counts_on("a", 8, 2, 6) and not bm.counts_on("a", 8, 1, 7)
    bm.abort_move(pending)
    assert not bm.counts_on("a", 8, 2, 7)
    moved = bm.relocate_remote("a", 0, 1, 2, (30, 31), copy_id=42, src_copy_id=41)
    assert moved.copy_id == 42 and bm.counts_on("a", 0, 2, 42) and not bm.counts_on("a", 0, 1, 41)
    bm.free("a")
    assert not bm.counts_on("a", 0, 2, 42)


def test_a_peers_copy_must_be_named():
    """Copy 0 would match no free and no audit: the live copy would be counted as not needed."""
    bm = BlockManager(block_size=4, pool_blocks=[8])
    bm.allocate("a", 20)
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match="positive id"):
            bm.lend_to_remote("a", 1, (10,), num_written=20, copy_id=bad)
    bm.commit_move(bm.lend_to_remote("a", 1, (10,), num_written=20, copy_id=5))
    with pytest.raises(ValueError, match="positive id"):
        bm.relocate_remote("a", 0, 1, 2, (11,), copy_id=0, src_copy_id=5)
    assert bm.block_table("a")[0] == Segment(1, (10,), 0, 4, 5)


def test_plan_spill_goes_on_to_further_creditors_for_one_request():
    """A lone request whose blocks no single creditor can hold lends them to several."""
    bm = BlockManager(block_size=4, pool_blocks=[4, 2, 2])
    bm.allocate("a", 16)
    assert bm.plan_spill(3, {"a": 16}) == [("a", 2, 1), ("a", 1, 2)]
    assert bm.plan_spill(9, {"a": 16}) == [("a", 2, 1), ("a", 2, 2)]  # creditors full: fewer than asked
    for request_id, num_blocks, dst in bm.plan_spill(3, {"a": 16}):  # carried out in order
        bm.commit_move(bm.lend(request_id, num_blocks, dst, num_written=16))
    assert [(s.instance_id, s.block_ids, s.token_start) for s in bm.block_table("a")] == [
        (1, (0, 1), 0), (2, (0,), 8), (0, (3,), 12)]
    assert bm.num_free_blocks(0) == 3


def test_max_allocatable_tokens_counts_the_tail_room_and_the_free_home_blocks():
    bm = BlockManager(block_size=4, pool_blocks=[4, 8])
    assert bm.max_allocatable_tokens("a") == 16
    bm.allocate("a", 6)  # 2 blocks, 2 slots left in the tail
    assert bm.max_allocatable_tokens("a") == 8 + 2 * 4
    assert bm.can_allocate("a", bm.max_allocatable_tokens("a"))
    assert not bm.can_allocate("a", bm.max_allocatable_tokens("a") + 1)
    bm.commit_move(bm.lend("a", 1, 1, num_written=6))
    assert bm.max_allocatable_tokens("a") == 8 + 3 * 4
