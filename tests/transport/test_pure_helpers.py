"""Coalescing KV moves into runs, and heartbeat placement diffs."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from infinite_llm.transport import messages as m
from infinite_llm.transport.block_runs import CopyRun, coalesce_runs
from infinite_llm.transport.placement import (
    PlacementGap,
    VersionedPlacement,
    apply_heartbeat,
    diff_placement,
    placement_of,
)


def test_runs_join_where_both_sides_continue():
    assert coalesce_runs([4, 5, 6, 9, 10], [0, 1, 3, 4, 5]) == [
        CopyRun(4, 0, 2), CopyRun(6, 3, 1), CopyRun(9, 4, 2)]


def test_runs_are_capped():
    assert coalesce_runs([0, 1, 2, 3, 4], [8, 9, 10, 11, 12], max_run_blocks=2) == [
        CopyRun(0, 8, 2), CopyRun(2, 10, 2), CopyRun(4, 12, 1)]


def test_runs_need_equal_lengths():
    with pytest.raises(ValueError):
        coalesce_runs([0, 1], [0])


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 50)), max_size=40))
def test_runs_cover_every_pair_in_order(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    expanded = [(r.src_block_id + i, r.dst_block_id + i)
                for r in coalesce_runs(src, dst) for i in range(r.num_blocks)]
    assert expanded == list(zip(src, dst))


def entry(req_id: int, inst_id: int, num_blocks: int) -> m.RequestPlacementEntry:
    return m.RequestPlacementEntry(req_id, inst_id, num_blocks, local=inst_id == 1)


def heartbeat(base: int, version: int, upserts=(), removals=()) -> m.Heartbeat:
    return m.Heartbeat(inst_id=1, seq=version, pool=m.PoolFigures(10, 5, 0, 2), batch_size=1,
                       placement_base_version=base, placement_version=version,
                       placement_upserts=tuple(upserts), placement_removals=tuple(removals))


def test_diff_then_apply_reaches_the_new_placement():
    old = placement_of([entry(1, 1, 4), entry(1, 2, 2), entry(2, 1, 1)])
    new = placement_of([entry(1, 1, 5), entry(1, 2, 2), entry(3, 1, 1)])
    upserts, removals = diff_placement(old, new)
    assert upserts == (entry(1, 1, 5), entry(3, 1, 1))
    assert removals == (m.PlacementKey(2, 1),)
    held = apply_heartbeat(VersionedPlacement(0, {}), heartbeat(0, 1, old.values()))
    held = apply_heartbeat(held, heartbeat(1, 2, upserts, removals))
    assert held == VersionedPlacement(2, new)


def test_a_diff_from_another_base_is_a_gap():
    held = VersionedPlacement(4, {})
    with pytest.raises(PlacementGap):
        apply_heartbeat(held, heartbeat(3, 5))
    assert apply_heartbeat(held, heartbeat(0, 9, [entry(1, 1, 1)])).version == 9


def test_a_request_completed_by_another_waits_progress_wakes_its_sleeper(monkeypatch):
    """One wait sleeps on the worker's fd; another's spin progresses the worker, which completes
    both requests and takes the event the sleeper waited for: the spinner wakes the sleeper,
    rather than the safety tick (made 5 s here) some time later."""
    import asyncio
    import os
    import time

    from infinite_llm.transport import ucx_progress

    monkeypatch.setattr(ucx_progress, "SAFETY_TICK_S", 5.0)

    class Request:
        completed = False

        def check_error(self) -> None: ...

    class Worker:
        """Completes its requests once ``ready``; its fd never fires (the event was taken)."""

        def __init__(self) -> None:
            self.read_fd, self.write_fd = os.pipe()
            self.epoll_file_descriptor = self.read_fd
            self.requests: list[Request] = []
            self.ready = False

        def progress(self) -> None:
            if self.ready:
                for request in self.requests:
                    request.completed = True

        def arm(self) -> bool:
            return True

    async def scenario() -> float:
        worker = Worker()
        progress = ucx_progress.UcxProgress(worker, asyncio.get_running_loop(), spin_s=0.0)
        sleeper, spinner = Request(), Request()
        worker.requests = [sleeper, spinner]
        asleep = asyncio.ensure_future(progress.wait(sleeper))
        await asyncio.sleep(0.01)  # it went to sleep at once (no spin)
        progress.spin_s = 1.0
        worker.ready = True
        started = time.monotonic()
        await progress.wait(spinner)  # its spin completes both
        await asyncio.wait_for(asleep, 2.0)
        progress.close()
        os.close(worker.read_fd)
        os.close(worker.write_fd)
        return time.monotonic() - started

    assert asyncio.run(scenario()) < 0.5
