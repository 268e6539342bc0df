"""The etcd election and membership through etcd faults, against real etcd processes: the loss
of the cluster member a client uses, a leader key replaced while the leader's watch was cut,
a stalled link and a restarted etcd that both stay within the lease's half-TTL margin."""

from __future__ import annotations

import asyncio
import logging
import time

import aetcd
import pytest

from infinite_llm.daemon.etcd_discovery import EtcdConnection, EtcdKeys, EtcdMembership, read_cluster
from infinite_llm.scheduler.etcd_election import EtcdElection
from etcd_faults_testlib import TcpProxy, etcd_cluster_of
from etcd_testlib import addresses, etcd, member, run  # noqa: F401  (etcd: the fixture)
from polling_testlib import until


async def leads_throughout(election: EtcdElection, until_s: float, what: str) -> None:
    """Assert ``is_leader()`` every 0.1 s until the monotonic time ``until_s``."""
    while time.monotonic() < until_s:
        assert election.is_leader(), f"{what}: {election._lost_reason}"
        await asyncio.sleep(0.1)


async def next_refresh(election: EtcdElection, timeout_s: float) -> float:
    """Wait for the next successful lease refresh; the clock time it was sent at, s."""
    before = election._lease_refreshed_at
    await until(lambda: election._lease_refreshed_at != before, timeout_s, "a lease refresh")
    return election._lease_refreshed_at


@pytest.fixture
def cluster():
    """A fresh 3-member cluster: a member killed and restarted on the same port could be skipped
    by a later test's clients, whose gRPC connections to that port may still be backing off."""
    cluster = etcd_cluster_of(3)
    yield cluster
    cluster.stop()


def endpoints_from_a_follower(cluster) -> tuple[int, list[str]]:
    """(index, endpoint list) where the member at ``index`` comes first and is not etcd's raft
    leader: killing it leaves a quorum and a leader, so no etcd election slows the survivors."""
    first = (cluster.leader_index() + 1) % len(cluster.endpoints)
    return first, [cluster.endpoints[first]] + [e for i, e in enumerate(cluster.endpoints) if i != first]


def test_the_election_moves_to_another_etcd_member_when_the_one_in_use_dies(cluster) -> None:
    ttl_s = 4
    first, endpoints = endpoints_from_a_follower(cluster)

    async def scenario():
        leader = EtcdElection(endpoints, prefix="/f-election", lease_ttl_s=ttl_s, request_timeout_s=1.0)
        standby = EtcdElection(endpoints, prefix="/f-election", lease_ttl_s=ttl_s, request_timeout_s=1.0)
        try:
            info = await asyncio.wait_for(leader.campaign(addresses(1000)), 5)
            standby_task = asyncio.create_task(standby.campaign(addresses(2000)))
            await asyncio.sleep(0.3)
            assert not standby_task.done()

            cluster.kill(first)
            # Two TTLs: a leader whose refreshes failed would have stepped down after half of one.
            await leads_throughout(leader, time.monotonic() + 2 * ttl_s, "stepped down with etcd in quorum")
            assert not standby_task.done() and not standby.is_leader()
            survivors = [e for i, e in enumerate(cluster.endpoints) if i != first]
            assert (await read_cluster(survivors, "/f-election"))[0] == info

            # The standby's watch moved too: it sees the resignation at once.
            leader.resign()
            successor = await asyncio.wait_for(standby_task, 3)
            assert successor.epoch > info.epoch and standby.is_leader()
        finally:
            await leader.close()
            await standby.close()

    run(scenario())


def test_membership_moves_to_another_etcd_member_when_the_one_in_use_dies(cluster) -> None:
    ttl_s = 4
    prefix = "/f-members"
    first, endpoints = endpoints_from_a_follower(cluster)
    survivors = [e for i, e in enumerate(cluster.endpoints) if i != first]

    async def scenario():
        publisher = EtcdMembership(endpoints, prefix=prefix, lease_ttl_s=ttl_s, request_timeout_s=1.0)
        reader = EtcdMembership(endpoints, prefix=prefix, lease_ttl_s=ttl_s, request_timeout_s=1.0)
        try:
            await publisher.start()
            await reader.start()
            publisher.publish(member(7))
            await until(lambda: 7 in reader.members(), 5, "member 7 seen")

            cluster.kill(first)
            await asyncio.sleep(2 * ttl_s)
            # The lease was refreshed through another member: the record outlived its TTL.
            _, members = await read_cluster(survivors, prefix, request_timeout_s=1.0)
            assert set(members) == {7}
            # The writer and the reader's watch both moved: an update goes through.
            publisher.publish(member(7, free=3))
            await until(lambda: 7 in reader.members() and reader.members()[7].num_blocks_free == 3, 5,
                        "update seen after the member loss")
        finally:
            await publisher.close()
            await reader.close()

    run(scenario())


def test_a_reconnection_tries_the_endpoints_after_the_one_in_use_first(cluster) -> None:
    async def scenario():
        connection = EtcdConnection(cluster.endpoints, request_timeout_s=1.0)
        await connection.open()
        try:
            visited = [connection.endpoint]
            for _ in range(3):
                await connection.reconnect(connection.client)
                visited.append(connection.endpoint)
            assert [f"{host}:{port}" for host, port in visited] == cluster.endpoints + cluster.endpoints[:1]
            # A failure seen on a client already replaced (by another task) changes nothing.
            in_use = connection.client
            await connection.reconnect(object())
            assert connection.client is in_use
        finally:
            await connection.close()

    run(scenario())


@pytest.mark.parametrize("successor", [False, True], ids=["deleted", "created-again"])
def test_a_leader_whose_key_changed_while_its_watch_was_cut_steps_down(etcd, successor) -> None:
    """The key goes (and, with a successor, is created again) while the leader's streams are
    cut; the leader's lease stays alive, so only the re-read on reconnect can tell it."""
    ttl_s = 10
    prefix = f"/f-resync-{'created' if successor else 'deleted'}"

    async def scenario():
        proxy = await TcpProxy(etcd.client_port).start()
        cut_off = EtcdElection(proxy.endpoint, prefix=prefix, lease_ttl_s=ttl_s, request_timeout_s=1.0)
        standby = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=ttl_s, request_timeout_s=1.0)
        host, port = etcd.endpoint.split(":")
        admin = aetcd.Client(host=host, port=int(port), timeout=2)
        try:
            info = await asyncio.wait_for(cut_off.campaign(addresses(1000)), 5)
            standby_task = asyncio.create_task(standby.campaign(addresses(2000))) if successor else None
            await asyncio.sleep(0.3)

            proxy.cut()
            await admin.delete(EtcdKeys(prefix).leader)
            if successor:
                successor_info = await asyncio.wait_for(standby_task, 5)
                assert successor_info.epoch > info.epoch
            await asyncio.sleep(0.5)
            proxy.heal()

            # Well before half the TTL: the step-down comes from the re-read, not the lease.
            await until(lambda: not cut_off.is_leader(), 4, "the cut-off leader stepped down")
            assert "the leader key was" in cut_off._lost_reason
            assert standby.is_leader() == successor
        finally:
            await cut_off.close()
            await standby.close()
            await admin.close()
            await proxy.close()

    run(scenario())


def test_a_refresh_that_times_out_in_a_stall_is_tried_again_within_the_margin(etcd, caplog) -> None:
    """TTL 8 s: refreshes every 2 s, each bounded by 0.5 s here; the leader gives up 4 s after
    the last good one. The link stalls from just after a refresh until 3.2 s later: the next
    refresh times out, and the one tried right after it lands before the 4 s margin."""
    ttl_s = 8

    async def scenario():
        proxy = await TcpProxy(etcd.client_port).start()
        election = EtcdElection(proxy.endpoint, prefix="/f-stall", lease_ttl_s=ttl_s, request_timeout_s=0.5)
        try:
            await asyncio.wait_for(election.campaign(addresses(1000)), 5)
            refreshed_at = await next_refresh(election, ttl_s / 4 + 1)
            proxy.stall()
            await asyncio.sleep(refreshed_at + 3.2 - time.monotonic())
            proxy.resume()
            await leads_throughout(election, refreshed_at + 6.0, "stepped down after a 3.2 s stall")
            assert election._lease_refreshed_at > refreshed_at + 2
        finally:
            await election.close()
            await proxy.close()

    with caplog.at_level(logging.WARNING, logger="infinite_llm.scheduler.etcd_election"):
        run(scenario())
    assert any("failed: no answer within 0.5 s" in r.getMessage() for r in caplog.records), caplog.text


def test_a_leader_keeps_leading_through_an_etcd_restart_within_the_margin(caplog) -> None:
    """TTL 16 s: refreshes every 4 s, the leader gives up 8 s after the last good one. etcd is
    killed just after a refresh and started again 4.2 s later, so the next refresh fails, and
    etcd needs a second or two more to serve. Refreshes tried again every half second, each
    failure on a fresh connection (no gRPC backoff to wait out), land once etcd is back."""
    ttl_s = 16
    single = etcd_cluster_of(1)

    async def scenario():
        election = EtcdElection(single.endpoints, prefix="/f-restart", lease_ttl_s=ttl_s, request_timeout_s=1.0)
        try:
            info = await asyncio.wait_for(election.campaign(addresses(1000)), 5)
            refreshed_at = await next_refresh(election, ttl_s / 4 + 1)
            single.kill(0)
            watching = asyncio.create_task(
                leads_throughout(election, refreshed_at + 10.0, "stepped down over an etcd restart"))
            await asyncio.sleep(refreshed_at + 4.2 - time.monotonic())
            await asyncio.to_thread(single.restart, 0)
            await watching
            assert election._lease_refreshed_at > refreshed_at + 4
            assert (await read_cluster(single.endpoints, "/f-restart"))[0] == info
        finally:
            await election.close()

    try:
        with caplog.at_level(logging.WARNING, logger="infinite_llm.scheduler.etcd_election"):
            run(scenario())
    finally:
        single.stop()
    assert any("refresh" in r.getMessage() and "failed" in r.getMessage() for r in caplog.records), \
        "no refresh failed while etcd was down"
