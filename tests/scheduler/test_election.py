"""The lock-file election: one leader per state folder, epochs that only grow, takeover on kill -9."""

from __future__ import annotations

import asyncio
import time

import pytest

from infinite_llm.scheduler.election import CandidateAddresses, LocalElection
from gmanager_testlib import GManagerProcess, leader_record

ADDRESSES = CandidateAddresses(peer_host="127.0.0.1", peer_port=1234, http_port=8080, socket_path="/tmp/gm.sock")


def campaign_within(election: LocalElection, timeout_s: float):
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await election.campaign(ADDRESSES)
    return asyncio.run(bounded())


def test_one_leader_per_folder_and_epochs_grow(tmp_path) -> None:
    first, second = LocalElection(tmp_path, poll_interval_s=0.01), LocalElection(tmp_path, poll_interval_s=0.01)
    info = campaign_within(first, 5)
    assert info.epoch == 1 and first.is_leader()
    assert second.leader() == info
    # flock conflicts between two open files even in one process: the second waits.
    with pytest.raises(TimeoutError):
        campaign_within(second, 0.2)
    assert not second.is_leader()
    first.resign()
    assert not first.is_leader() and first.leader() is None
    assert campaign_within(second, 5).epoch == 2
    second.resign()
    assert campaign_within(first, 5).epoch == 3
    assert (tmp_path / "gmanager.epoch").read_text().strip() == "3"


def test_removing_the_election_folder_does_not_start_the_epochs_again(tmp_path) -> None:
    """The folder's removal deposes the leader; the instances have seen its epoch and refuse
    any lower one, so the next leader's must be higher. A counter where earlier versions kept
    it, in the folder, counts too."""
    import shutil

    first = LocalElection(tmp_path, poll_interval_s=0.01)
    assert campaign_within(first, 5).epoch == 1
    shutil.rmtree(tmp_path / "gmanager")
    assert not first.is_leader()
    second = LocalElection(tmp_path, poll_interval_s=0.01)
    assert campaign_within(second, 5).epoch == 2
    second.resign()
    (tmp_path / "gmanager" / "epoch").write_text("9\n")
    assert campaign_within(LocalElection(tmp_path, poll_interval_s=0.01), 5).epoch == 10


def test_removing_the_lock_file_loses_leadership(tmp_path) -> None:
    election = LocalElection(tmp_path, poll_interval_s=0.01)
    campaign_within(election, 5)
    (tmp_path / "gmanager" / "leader.lock").unlink()
    assert not election.is_leader()
    # A new lock file is a new race: another replica may win it, the old leader holds nothing.
    other = LocalElection(tmp_path, poll_interval_s=0.01)
    assert campaign_within(other, 5).epoch == 2
    assert other.is_leader() and not election.is_leader()


def test_corrupt_epoch_counter_stops_the_election(tmp_path) -> None:
    (tmp_path / "gmanager.epoch").write_text("not a number")
    with pytest.raises(ValueError):
        campaign_within(LocalElection(tmp_path), 5)


def test_standby_takes_over_after_kill_9(tmp_path) -> None:
    state_dir = tmp_path / "state"
    first = GManagerProcess(state_dir, "gm-a")
    second = None
    try:
        status = first.wait_leading()
        assert status["epoch"] == 1 and leader_record(state_dir)["pid"] == first.process.pid
        second = GManagerProcess(state_dir, "gm-b")
        standby = second.wait_serving()
        assert not standby["leader"] and standby["leader_pid"] == first.process.pid
        # A standby refuses to plan.
        code, body = second.request("POST", "/v1/rebalance", {"dry_run": True})
        assert code == 503 and "standby" in body["error"]

        first.kill()
        killed_at = time.monotonic()
        status = second.wait_leading(timeout_s=10)
        takeover_s = time.monotonic() - killed_at
        assert status["epoch"] == 2 and takeover_s < 5, takeover_s
        record = leader_record(state_dir)
        assert record["epoch"] == 2 and record["pid"] == second.process.pid
        assert record["http_port"] == status["http_port"] and record["peer_port"] == int(status["peer_address"].split(":")[1])

        # SIGTERM: a graceful exit that resigns (the leader record goes with it).
        assert second.stop() == 0
        assert not (state_dir / "gmanager" / "leader.json").exists()
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_a_leader_whose_lock_file_is_removed_steps_down(tmp_path) -> None:
    state_dir = tmp_path / "state"
    leader = GManagerProcess(state_dir, "gm")
    try:
        leader.wait_leading()
        (state_dir / "gmanager" / "leader.lock").unlink()
        assert leader.process.wait(timeout=10) == 3, leader.log()
        assert "lost leadership" in leader.log()
    finally:
        leader.kill()
