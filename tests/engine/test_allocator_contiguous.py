"""Reservations for a peer's segment prefer one run of consecutive blocks."""

from __future__ import annotations

import pytest

from infinite_llm.engine.block_manager import BlockAllocator, BlockManager, OutOfBlocks


def test_lowest_consecutive_run_is_taken():
    allocator = BlockAllocator(0, 20)
    allocator.allocate(10)  # 0..9
    allocator.free([1, 3, 5, 6, 7])
    assert allocator.allocate_contiguous(3) == [5, 6, 7]
    assert allocator.allocate_contiguous(2) == [10, 11]
    assert allocator.allocate(2) == [1, 3]  # the free list is still a heap


def test_falls_back_to_lowest_ids_without_a_run():
    allocator = BlockAllocator(0, 8)
    allocator.allocate(8)
    allocator.free([0, 2, 4, 6])
    assert allocator.allocate_contiguous(3) == [0, 2, 4]
    with pytest.raises(OutOfBlocks):
        allocator.allocate_contiguous(2)


def test_home_reservations_are_contiguous_where_possible():
    manager = BlockManager(block_size=4, pool_blocks=(32,))
    manager.allocate("a", 4 * 6)  # blocks 0..5
    taken = manager.reserve_home_blocks(3)
    assert taken == [6, 7, 8]
    manager.release_home_blocks(taken)
    assert manager.num_free_blocks(0) == 26
