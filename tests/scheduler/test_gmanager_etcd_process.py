"""Real gManager processes and a real `infinited` against a real etcd.

* kill -9 of the leader: the standby leads within the lease TTL + 1 s, with a larger epoch;
* SIGSTOP of the leader past its TTL: the standby takes over and the instance learns the new
  epoch from its heartbeat replies; on SIGCONT the old leader finds its lease unrefreshed for
  over half its TTL and steps down (exit 3) without commanding; a command stamped with its
  epoch is refused by the instance and counted (status and /metrics);
* the instance registered through etcd (infctl finds it and the leader there); killed with
  SIGKILL, it leaves the membership once its lease expires.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request

import pytest

from infinite_llm.cli.client import ClusterClient
from infinite_llm.daemon.etcd_discovery import read_cluster
from infinite_llm.daemon.local_cluster import LocalCluster
from infinite_llm.transport.errors import RemoteError
from infinite_llm.transport.messages import MoveKV
from etcd_testlib import etcd  # noqa: F401  (etcd: the fixture)
from gmanager_testlib import GManagerProcess, HeartbeatSender

TTL_S = 2  # the leader's and the instance's lease, s
PREFIX = "/gm-process"


def gmanager(etcd, tmp_path, name: str, prefix: str = PREFIX) -> GManagerProcess:
    return GManagerProcess(tmp_path / "state", name, [
        "--etcd-endpoints", etcd.endpoint, "--etcd-prefix", prefix, "--etcd-lease-ttl-s", str(TTL_S),
        "--heartbeat-interval-s", "0.3", "--election-poll-s", "0.05"])


def read(etcd, prefix: str = PREFIX):
    return asyncio.run(asyncio.wait_for(read_cluster(etcd.endpoint, prefix), 10))


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"{what}: not within {timeout_s} s")


def test_standby_leads_within_the_ttl_after_kill_9(etcd, tmp_path) -> None:
    prefix = "/gm-kill"
    first = gmanager(etcd, tmp_path, "gm-a", prefix)
    second = None
    try:
        status = first.wait_leading()
        leader, _ = read(etcd, prefix)
        assert leader.pid == first.process.pid and leader.epoch == status["epoch"]
        second = gmanager(etcd, tmp_path, "gm-b", prefix)  # started once the first leads: a standby
        assert not second.wait_serving()["leader"]
        # The standby names the leader once its first read of the key is in.
        wait_for(lambda: second.status()["leader_pid"] == first.process.pid, 10, "standby sees the leader")

        first.kill()
        killed_at = time.monotonic()
        status = second.wait_leading(timeout_s=TTL_S + 5)
        takeover_s = time.monotonic() - killed_at
        assert takeover_s < TTL_S + 1, takeover_s
        assert status["epoch"] > leader.epoch
        assert read(etcd, prefix)[0].pid == second.process.pid
        assert second.stop() == 0, second.log()  # a clean stop resigns: no leader left
        assert read(etcd, prefix)[0] is None
    finally:
        first.kill()
        if second is not None:
            second.kill()


@pytest.fixture(scope="module")
def instance(etcd, tmp_path_factory):
    cluster = LocalCluster(tmp_path_factory.mktemp("cluster"), num_instances=1, pool_blocks=64, extra_args=[
        "--etcd-endpoints", etcd.endpoint, "--etcd-prefix", PREFIX, "--etcd-lease-s", str(TTL_S),
        "--heartbeat-interval-s", "0.3"])
    try:
        process = cluster[1].process

        def registered():
            if process.poll() is not None:
                pytest.fail(f"instance 1 exited: {cluster[1].log_path.read_text()[-3000:]}")
            return read(etcd)[1]

        members = wait_for(registered, 120, "instance 1 registered in etcd")
        assert set(members) == {1} and members[1].pid == process.pid
        assert not (cluster.state_dir / "members").exists()  # nothing went to the state folder
        cluster[1].http_port = members[1].http_port
        yield cluster
    finally:
        cluster.stop()


def test_a_paused_leader_steps_down_and_its_epoch_is_refused(etcd, tmp_path, instance) -> None:
    inst = instance[1]
    first = gmanager(etcd, tmp_path, "gm-a")
    second = None
    sender = HeartbeatSender()
    try:
        epoch_1 = first.wait_leading()["epoch"]
        second = gmanager(etcd, tmp_path, "gm-b")
        assert not second.wait_serving()["leader"]
        # The instance finds the leader in etcd and learns its epoch from the heartbeat replies.
        wait_for(lambda: inst.status()["epoch"] == epoch_1, 10, "instance at epoch 1")
        wait_for(lambda: any(i["instance_id"] == 1 for i in first.status()["instances"]), 10, "heartbeats")
        refused_before = inst.status()["stale_epoch_commands"]

        os.kill(first.process.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        epoch_2 = second.wait_leading(timeout_s=TTL_S + 5)["epoch"]
        assert time.monotonic() - stopped_at < TTL_S + 1
        assert epoch_2 > epoch_1
        wait_for(lambda: inst.status()["epoch"] == epoch_2, 10, "instance at epoch 2")

        # infctl finds the new leader and the instance through etcd.
        client = ClusterClient(tmp_path / "elsewhere", etcd_endpoints=etcd.endpoint, etcd_prefix=PREFIX)
        assert client.leader().pid == second.process.pid
        assert set(client.instances()) == {1}
        assert client.status()["epoch"] == epoch_2

        os.kill(first.process.pid, signal.SIGCONT)
        # Half the TTL without a refresh: it steps down at once, before commanding anything.
        assert first.process.wait(timeout=10) == 3, first.log()
        log = first.log()
        assert "over half its 2 s TTL" in log and "lost leadership" in log
        assert "move" not in log.split("lost leadership")[-1]
        assert inst.status()["stale_epoch_commands"] == refused_before  # it sent nothing
        assert read(etcd)[0].pid == second.process.pid  # stepping down left the new leader alone

        # Whatever a deposed leader still sends is refused by an instance that saw the newer
        # epoch, and counted.
        sender.start()
        peer = _peer_of(etcd)
        for move_id in (1, 2):
            reply = sender.send(peer, MoveKV(epoch=epoch_1, move_id=move_id, home_inst_id=1, req_id=1, src_inst_id=1,
                                             dst_inst_id=2, num_blocks=1))
            assert isinstance(reply, RemoteError) and f"epoch {epoch_1} is older than {epoch_2}" in reply.detail
        status = inst.status()
        assert status["stale_epoch_commands"] == refused_before + 2
        with urllib.request.urlopen(f"http://127.0.0.1:{inst.http_port}/metrics", timeout=10) as response:
            metrics = response.read().decode()
        assert f"infllm_stale_epoch_commands_total {float(refused_before + 2)}" in metrics
    finally:
        sender.close()
        if first.process.poll() is None:
            os.kill(first.process.pid, signal.SIGCONT)
        first.kill()
        if second is not None:
            assert second.stop() == 0, second.log()


def test_a_killed_instance_leaves_etcd_after_its_lease(etcd, instance) -> None:
    process = instance[1].process
    assert 1 in read(etcd)[1]
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    killed_at = time.monotonic()
    wait_for(lambda: 1 not in read(etcd)[1], TTL_S + 3, "instance 1 gone from etcd")
    assert time.monotonic() - killed_at < TTL_S + 1.5


def _peer_of(etcd):
    from infinite_llm.transport.interface import PeerAddress

    member = read(etcd)[1][1]
    return PeerAddress(member.peer_host, member.peer_port)
