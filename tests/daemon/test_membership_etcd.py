"""Membership through a real etcd: records under a lease, seen by watchers, malformed ones
skipped, gone on withdraw, on a clean stop and when the lease runs out; infctl reads the same."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import aetcd
from typer.testing import CliRunner

from infinite_llm.cli.client import ClusterClient
from infinite_llm.cli.main import app
from infinite_llm.daemon.etcd_discovery import EtcdKeys, EtcdMembership, EtcdUnreachable
from etcd_testlib import closed_port, etcd, member, run  # noqa: F401  (etcd: the fixture)
from polling_testlib import until

TTL_S = 2


def test_publish_watch_withdraw_and_malformed_records(etcd) -> None:
    prefix = "/m-basic"
    keys = EtcdKeys(prefix)

    async def scenario():
        publisher = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        reader = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        host, port = etcd.endpoint.split(":")
        raw = aetcd.Client(host=host, port=int(port), timeout=2)
        try:
            # Records that are not members: skipped by readers that start before and after them.
            await raw.put(keys.member(90), b"{half a record")
            await raw.put(keys.member(91), json.dumps({"inst_id": 91}).encode())
            await raw.put(keys.member(92), json.dumps(dataclasses.asdict(member(93))).encode())  # key and id disagree
            await reader.start()
            await publisher.start()
            assert reader.members() == {} and reader.leader() is None

            publisher.publish(member(1))
            await until(lambda: 1 in reader.members(), 5, "member 1 seen")
            seen = reader.members()
            assert set(seen) == {1} and dataclasses.replace(seen[1], updated_at=0) == dataclasses.replace(
                member(1), updated_at=0)
            kv = await raw.get(keys.member(1))
            assert kv.lease != 0  # under the publisher's lease

            publisher.publish(member(1, free=3))  # an update replaces the record
            await until(lambda: reader.members()[1].num_blocks_free == 3, 5, "update seen")
            await raw.put(keys.member(94), b"[]")  # malformed, arriving through the watch
            await asyncio.sleep(0.3)
            assert set(reader.members()) == {1}

            publisher.withdraw(1)
            await until(lambda: 1 not in reader.members(), 5, "withdrawn")
            publisher.publish(member(2))
            await until(lambda: 2 in reader.members(), 5, "member 2 seen")
            await publisher.close()  # the lease is revoked: the record goes at once
            await until(lambda: 2 not in reader.members(), 1.5, "gone on close")
        finally:
            await publisher.close()
            await reader.close()
            await raw.close()

    run(scenario())


def test_a_record_expires_with_its_lease(etcd) -> None:
    """A publisher that stops refreshing (killed) leaves the membership after its TTL."""
    prefix = "/m-expire"

    async def scenario():
        publisher = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        reader = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            await reader.start()
            await publisher.start()
            publisher.publish(member(7))
            await until(lambda: 7 in reader.members(), 5, "member 7 seen")
            for task in publisher._tasks:  # what SIGKILL does to the refreshes
                task.cancel()
            gone_s = await until(lambda: 7 not in reader.members(), TTL_S + 2, "expired")
            assert gone_s < TTL_S + 1.5, gone_s
        finally:
            publisher._lease = None  # nothing left to revoke
            await publisher.close()
            await reader.close()

    run(scenario())


def test_a_publisher_whose_lease_expired_registers_again(etcd) -> None:
    prefix = "/m-again"

    async def scenario():
        publisher = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        reader = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            await reader.start()
            await publisher.start()
            assert not await publisher.wait_published(3, 0.05)  # nothing published yet
            publisher.publish(member(3))
            assert await publisher.wait_published(3, 5)  # in etcd: what READY waits for
            await until(lambda: 3 in reader.members(), 5, "member 3 seen")
            await publisher._connection.client.revoke_lease(publisher._lease.id)  # as if it expired in a pause
            await until(lambda: 3 not in reader.members(), 5, "gone with the lease")
            publisher.publish(member(3))  # the next tick's publish
            await until(lambda: 3 in reader.members(), 5, "registered again")
        finally:
            await publisher.close()
            await reader.close()

    run(scenario())


def test_infctl_finds_the_cluster_in_etcd(etcd) -> None:
    prefix = "/m-infctl"

    async def publish_one(publisher: EtcdMembership):
        await publisher.start()
        publisher.publish(member(4))
        reader = EtcdMembership(etcd.endpoint, prefix=prefix)
        await reader.start()
        await until(lambda: 4 in reader.members(), 5, "member 4 seen")
        await reader.close()

    loop = asyncio.new_event_loop()
    publisher = EtcdMembership(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
    try:
        loop.run_until_complete(asyncio.wait_for(publish_one(publisher), 10))
        client = ClusterClient("/nonexistent", etcd_endpoints=etcd.endpoint, etcd_prefix=prefix)
        assert set(client.instances()) == {4} and client.instances()[4]["peer_port"] == 5004
        runner = CliRunner()
        # No leader: the one-line error names etcd; the instance is listed but its socket is not here.
        result = runner.invoke(app, ["rebalance", "--etcd", etcd.endpoint, "--etcd-prefix", prefix])
        assert result.exit_code == 3 and "no gManager leader in etcd at" in result.output, result.output
        result = runner.invoke(app, ["uncordon", "4"], env={"INFCTL_ETCD": etcd.endpoint,
                                                           "INFCTL_ETCD_PREFIX": prefix})
        assert result.exit_code == 3 and "/run/i4.sock does not answer" in result.output, result.output
    finally:
        loop.run_until_complete(asyncio.wait_for(publisher.close(), 10))
        loop.close()


def test_unreachable_etcd_is_a_clear_bounded_error() -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    try:
        run(EtcdMembership(endpoint, request_timeout_s=1.0).start(), 10)
    except EtcdUnreachable as exc:
        assert f"no etcd answers within 1 s: {endpoint}" in str(exc)
    else:
        raise AssertionError("start() succeeded without an etcd")
    result = CliRunner().invoke(app, ["status", "--etcd", endpoint])
    assert result.exit_code == 3 and "no etcd answers within" in result.output and "Traceback" not in result.output
    result = CliRunner().invoke(app, ["status", "--etcd", "no-port-here"])
    assert result.exit_code == 2 and "etcd endpoint must be host:port" in result.output  # a usage error
    assert time.monotonic() - started < 10


class _EtcdWithoutQuorum:
    """A stand-in etcd on a loopback gRPC port that answers what a member cut off from its
    cluster's quorum answers: its status (and member list), but no read: a Range waits."""

    def __init__(self) -> None:
        import threading
        from concurrent import futures

        import grpc
        from aetcd.rpc import rpc_pb2, rpc_pb2_grpc

        released = self.released = threading.Event()

        class Maintenance(rpc_pb2_grpc.MaintenanceServicer):
            def Status(self, request, context):
                return rpc_pb2.StatusResponse(version="3.4.23", leader=0)

        class Cluster(rpc_pb2_grpc.ClusterServicer):
            def MemberList(self, request, context):
                return rpc_pb2.MemberListResponse()

        class KV(rpc_pb2_grpc.KVServicer):
            def Range(self, request, context):
                released.wait(30)  # etcd's own request timeout comes much later than the client's
                context.abort(grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out")

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(Maintenance(), self.server)
        rpc_pb2_grpc.add_ClusterServicer_to_server(Cluster(), self.server)
        rpc_pb2_grpc.add_KVServicer_to_server(KV(), self.server)
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def stop(self) -> None:
        self.released.set()
        self.server.stop(grace=None).wait(10)


def test_an_etcd_that_answers_its_status_but_no_read_is_named_with_the_wait() -> None:
    """start() says which endpoint did not answer which read within what wait (a bare timeout
    has no text of its own); the daemon prints that in one line and exits 1."""
    import subprocess
    import sys
    import tempfile

    no_quorum = _EtcdWithoutQuorum()
    try:
        started = time.monotonic()
        try:
            run(EtcdMembership(no_quorum.endpoint, request_timeout_s=0.5).start(), 10)
        except EtcdUnreachable as exc:
            assert str(exc) == f"no answer from etcd {no_quorum.endpoint} within 0.5 s reading /infinite-llm"
        else:
            raise AssertionError("start() succeeded without an answer to its read")
        assert time.monotonic() - started < 5
        with tempfile.TemporaryDirectory() as state_dir:
            result = subprocess.run(
                [sys.executable, "-m", "infinite_llm.daemon", "--etcd-endpoints", no_quorum.endpoint, "--etcd-prefix",
                 "/cluster-b", "--etcd-request-s", "0.5", "--http-port", "0", "--socket-path", f"{state_dir}/s.sock",
                 "--state-dir", state_dir], capture_output=True, text=True, timeout=120)
        assert result.returncode == 1, result.stderr
        assert "Traceback" not in result.stderr, result.stderr
        assert result.stderr.strip().splitlines()[-1] == (
            f"infinited: no answer from etcd {no_quorum.endpoint} within 0.5 s reading /cluster-b"), result.stderr
    finally:
        no_quorum.stop()
