"""A real gManager process over loopback UCX: heartbeats, its admin API, a dry-run rebalance,
its admin socket."""

from __future__ import annotations

import asyncio
import socket

import pytest

from infinite_llm.scheduler.gmanager import AdminSocketInUse
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.messages import CreditorHint, HeartbeatReply
from gmanager_testlib import Cluster, GManagerProcess, HeartbeatSender, heartbeat, leader_address


@pytest.fixture(scope="module")
def gmanager(tmp_path_factory):
    # Rounds only on demand here (a long plan interval), and no instance falls silent mid-test.
    process = GManagerProcess(tmp_path_factory.mktemp("gm") / "state", "gm",
                              ["--plan-interval-s", "3600", "--heartbeat-interval-s", "30"])
    try:
        process.wait_leading()
        yield process
    finally:
        assert process.stop() == 0, process.log()


@pytest.fixture(scope="module")
def sender():
    sender = HeartbeatSender()
    try:
        sender.start()
        yield sender
    finally:
        sender.close()


def test_heartbeats_full_diff_gap_and_refusals(gmanager, sender) -> None:
    peer = leader_address(gmanager.state_dir)
    reply = sender.send(peer, heartbeat(11, 1, 64, 40, 2, 0, 1, upserts=((1, 11, 14), (2, 11, 10))))
    assert reply == HeartbeatReply(epoch=1, acked_placement_version=1, needs_full_placement=False, creditors=())
    reply = sender.send(peer, heartbeat(12, 1, 64, 60, 1, 0, 1, upserts=((5, 12, 4),)))
    assert reply == HeartbeatReply(1, 1, False, (CreditorHint(11, 40),))
    # A diff on the held version: acked, and instance 12 is named as the roomier creditor.
    reply = sender.send(peer, heartbeat(11, 2, 64, 50, 1, 1, 2, upserts=((1, 11, 14),), removals=((2, 11),)))
    assert reply == HeartbeatReply(1, 2, False, (CreditorHint(12, 60),))
    # A lost heartbeat: the diff's base (3) is not held (2).
    reply = sender.send(peer, heartbeat(11, 4, 64, 50, 1, 3, 4))
    assert reply == HeartbeatReply(1, 2, True, (CreditorHint(12, 60),))
    reply = sender.send(peer, heartbeat(11, 5, 64, 50, 1, 0, 5, upserts=((1, 11, 14),)))
    assert reply == HeartbeatReply(1, 5, False, (CreditorHint(12, 60),))

    before = gmanager.status()["heartbeats"]
    impossible = sender.send(peer, heartbeat(13, 1, 64, 65, 0, 0, 1))  # more free blocks than the pool
    assert isinstance(impossible, RemoteError) and "exceed the pool" in impossible.detail
    replayed = sender.send(peer, heartbeat(11, 5, 64, 50, 1, 5, 6))
    assert isinstance(replayed, RemoteError) and "not newer" in replayed.detail
    after = gmanager.status()["heartbeats"]
    assert after["refused"] == before["refused"] + 2 and after["taken"] == before["taken"]
    assert after["placement_gaps"] == 1

    status = gmanager.status()
    assert status["leader"] and status["epoch"] == 1
    by_id = {i["instance_id"]: i for i in status["instances"]}
    assert sorted(by_id) == [11, 12]  # the refused instance 13 was not kept
    assert by_id[11]["num_blocks_free"] == 50 and by_id[11]["batch_size"] == 1
    assert by_id[11]["pool_used_fraction"] == pytest.approx(14 / 64)
    assert by_id[11]["placement_version"] == 5 and 0 <= by_id[11]["last_heartbeat_age_s"] < 30


def test_status_of_one_instance_and_roles(gmanager, sender) -> None:
    peer = leader_address(gmanager.state_dir)
    assert isinstance(sender.send(peer, heartbeat(21, 1, 64, 30, 1, 0, 1, upserts=((1, 21, 20), (1, 22, 6)),
                                                  borrowed=6)), HeartbeatReply)
    assert isinstance(sender.send(peer, heartbeat(22, 1, 64, 50, 1, 0, 1, upserts=((3, 22, 8),), lent=6)),
                      HeartbeatReply)
    code, debtor = gmanager.request("GET", "/v1/instances/21")
    assert code == 200 and debtor["role"] == "debtor" and debtor["num_blocks_borrowed"] == 6
    code, creditor = gmanager.request("GET", "/v1/instances/22")
    assert code == 200 and creditor["role"] == "creditor" and creditor["num_blocks_lent"] == 6
    code, body = gmanager.request("GET", "/v1/instances/99")
    assert code == 404 and "unknown instance 99" in body["error"]
    code, body = gmanager.request("GET", "/v1/instances/first")
    assert code == 400


@pytest.mark.parametrize("body, error", [
    ({"dry_run": True, "force": True}, "unknown fields: force"),
    ({"dry_run": "yes"}, "dry_run must be true or false"),
    ([True], "must be a JSON object"),
    (b"{not json", "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "nests arrays or objects too deeply"),
])
def test_rebalance_refuses_bad_input(gmanager, body, error) -> None:
    code, reply = gmanager.request("POST", "/v1/rebalance", body)
    assert code == 400 and error in reply["error"]


def test_dry_run_plans_moves_off_a_debtor_with_gains(gmanager, sender) -> None:
    """Instance 31 runs one long request in a full pool; instance 32 is empty."""
    peer = leader_address(gmanager.state_dir)
    assert isinstance(sender.send(peer, heartbeat(31, 1, 64, 4, 1, 0, 1, upserts=((77, 31, 60),))), HeartbeatReply)
    assert isinstance(sender.send(peer, heartbeat(32, 1, 64, 64, 0, 0, 1)), HeartbeatReply)
    code, plan = gmanager.request("POST", "/v1/rebalance", {"dry_run": True})
    assert code == 200 and plan["epoch"] == 1 and plan["dry_run"]
    moves = [m for m in plan["moves"] if m["req_id"] == 77]
    assert moves, plan
    for move in moves:
        assert (move["home_inst_id"], move["src_inst_id"]) == (31, 31)
        assert move["dst_inst_id"] != 31 and 0 < move["num_blocks"] < 60
        assert move["predicted_gain_tokens_per_s"] > 0 and move["result"] == "not_sent"
    assert moves[0]["dst_inst_id"] == 32  # the least used creditor

    # Sent for real, the moves find no address (these instances never published one): counted.
    before = gmanager.status()["moves"].get("no_address", 0)
    code, sent = gmanager.request("POST", "/v1/rebalance", {"dry_run": False})
    assert code == 200 and sent["moves"] and {m["result"] for m in sent["moves"]} == {"no_address"}
    status = gmanager.status()
    assert status["moves"]["no_address"] == before + len(sent["moves"])
    assert status["rounds"]["completed"] >= 1


def test_rebalance_on_disagreeing_heartbeats_is_a_conflict(gmanager, sender) -> None:
    """Instance 41 says 30 blocks of its request are on 42, which has none in use."""
    peer = leader_address(gmanager.state_dir)
    assert isinstance(sender.send(peer, heartbeat(41, 1, 64, 34, 1, 0, 1, upserts=((1, 41, 30), (1, 42, 30)),
                                                  borrowed=30)), HeartbeatReply)
    assert isinstance(sender.send(peer, heartbeat(42, 1, 64, 64, 0, 0, 1)), HeartbeatReply)
    code, body = gmanager.request("POST", "/v1/rebalance", {"dry_run": True})
    assert code == 409 and "placement holds 30 blocks" in body["error"]
    # Instance 41's next full placement agrees: planning works again.
    assert isinstance(sender.send(peer, heartbeat(41, 2, 64, 34, 1, 0, 2, upserts=((1, 41, 30),))), HeartbeatReply)
    code, body = gmanager.request("POST", "/v1/rebalance", {"dry_run": True})
    assert code == 200


def test_a_replica_removes_its_socket_at_exit_and_leaves_a_live_one_alone(tmp_path) -> None:
    """The default socket <state_dir>/gmanager/<pid>.sock goes with its replica. A second
    replica given a path where another process answers refuses to start, and leaves it."""
    first = GManagerProcess(tmp_path / "state", "first", default_socket_path=True)
    try:
        first.wait_leading()
        assert first.socket_path.is_socket()
        second = GManagerProcess(tmp_path / "state2", "second", ["--socket-path", str(first.socket_path)])
        try:
            assert second.process.wait(timeout=60) == 1, second.log()
        finally:
            second.kill()
        assert f"socket path {first.socket_path} is in use" in second.log()
        assert first.status()["leader"]  # still answers on its socket
    finally:
        assert first.stop() == 0, first.log()
    assert not first.socket_path.exists()
    assert [p.name for p in (tmp_path / "state" / "gmanager").iterdir() if p.suffix == ".sock"] == []


def test_a_socket_left_by_a_killed_process_is_replaced_and_a_plain_file_is_not(tmp_path) -> None:
    c = Cluster(tmp_path)
    path = c.gm.socket_path
    path.parent.mkdir(parents=True)
    with socket.socket(socket.AF_UNIX) as left:  # bound, never unlinked: nobody answers on it
        left.bind(str(path))

    async def scenario() -> None:
        await c.gm._claim_socket_path()
        assert not path.exists()
        path.write_text("not a socket")
        with pytest.raises(AdminSocketInUse, match="exists and is not a socket"):
            await c.gm._claim_socket_path()
        assert path.read_text() == "not a socket"

    asyncio.run(scenario())


def test_the_admin_socket_can_be_given_to_the_admin_group(tmp_path) -> None:
    """--socket-group: the socket's group and mode 0660, for operators in that group; an unknown
    group is refused before anything starts."""
    import grp
    import os
    import stat
    import subprocess
    import sys

    group = grp.getgrgid(os.getgid()).gr_name
    gm = GManagerProcess(tmp_path / "state", "grouped", ["--socket-group", group])
    try:
        gm.wait_leading()
        mode = os.stat(gm.socket_path)
        assert (stat.S_IMODE(mode.st_mode), mode.st_gid) == (0o660, os.getgid())
    finally:
        assert gm.stop() == 0, gm.log()
    refused = subprocess.run([sys.executable, "-m", "infinite_llm.scheduler.gmanager", "--state-dir", str(tmp_path),
                              "--perf-model", "x.json", "--socket-group", "no-such-group-x"],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "no group 'no-such-group-x'" in refused.stderr
