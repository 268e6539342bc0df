"""The etcd election against a real etcd: one leader per key, create-revision epochs that grow,
standbys that watch, takeover within the lease TTL, half-TTL step-down, bounded failures."""

from __future__ import annotations

import asyncio
import json
import time

import aetcd
import pytest

from infinite_llm.daemon.etcd_discovery import EtcdKeys, EtcdUnreachable, read_cluster
from infinite_llm.scheduler.etcd_election import EtcdElection
from etcd_testlib import addresses, closed_port, etcd, run  # noqa: F401  (etcd: the fixture)

TTL_S = 2  # the shortest lease etcd grants with its default election timeout


async def raw_get(endpoint: str, key: bytes):
    host, port = endpoint.split(":")
    async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
        return await client.get(key)


async def campaign_within(election: EtcdElection, port: int, timeout_s: float):
    async with asyncio.timeout(timeout_s):
        return await election.campaign(addresses(port))


def test_leader_epoch_is_the_create_revision_and_a_standby_takes_over_on_resign(etcd) -> None:
    prefix = "/t-resign"

    async def scenario():
        first = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        second = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            info = await campaign_within(first, 1000, 5)
            assert first.is_leader() and info.peer_port == 1000 and info.http_port == 1001
            kv = await raw_get(etcd.endpoint, EtcdKeys(prefix).leader)
            assert kv is not None and info.epoch == kv.create_revision and kv.lease != 0
            assert "epoch" not in json.loads(kv.value)  # the revision is the only epoch

            # The second candidate waits while the first leads (and learns who leads).
            standby = asyncio.create_task(second.campaign(addresses(2000)))
            await asyncio.sleep(0.5)
            assert not standby.done() and not second.is_leader()
            assert second.leader() == info

            # A third client finds the leader with one read.
            leader, members = await read_cluster(etcd.endpoint, prefix)
            assert leader == info and members == {}

            # Resign: the lease is revoked, the key goes, the watching standby leads at once.
            resigned_at = time.monotonic()
            first.resign()
            assert not first.is_leader()
            second_info = await asyncio.wait_for(standby, timeout=5)
            assert time.monotonic() - resigned_at < 1.5  # the watch fired, no TTL wait
            assert second.is_leader() and second_info.epoch > info.epoch and second_info.peer_port == 2000
            kv = await raw_get(etcd.endpoint, EtcdKeys(prefix).leader)
            assert kv.create_revision == second_info.epoch
            assert (await read_cluster(etcd.endpoint, prefix))[0] == second_info
            assert first.leader() == second_info  # the old leader's watch saw the new one
        finally:
            await first.close()
            await second.close()
        # A clean stop revokes the lease: no leader left.
        assert await raw_get(etcd.endpoint, EtcdKeys(prefix).leader) is None

    run(scenario())


def test_a_leader_that_stops_refreshing_loses_the_key_after_its_ttl(etcd) -> None:
    """The leader's refreshes stop (as in a long pause): the standby leads within TTL + 1 s,
    and the old leader no longer claims to lead once half the TTL has passed unrefreshed."""
    prefix = "/t-expire"

    async def scenario():
        first = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        second = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            info = await campaign_within(first, 1000, 5)
            standby = asyncio.create_task(second.campaign(addresses(2000)))
            await asyncio.sleep(0.3)
            first._keep_alive_task.cancel()  # what a paused process does: nothing
            stopped_at = time.monotonic()
            assert first.is_leader()
            await asyncio.sleep(TTL_S / 2)
            assert not first.is_leader()  # half the TTL without a refresh: stepped down
            second_info = await asyncio.wait_for(standby, timeout=TTL_S + 3)
            takeover_s = time.monotonic() - stopped_at
            assert takeover_s < TTL_S + 1, takeover_s
            assert second_info.epoch > info.epoch and second.is_leader() and not first.is_leader()
        finally:
            await first.close()
            await second.close()

    run(scenario())


def test_half_ttl_rule_on_a_fake_clock(etcd) -> None:
    now = [100.0]
    election = EtcdElection(etcd.endpoint, prefix="/t-clock", lease_ttl_s=4, clock=lambda: now[0])

    async def scenario():
        try:
            await campaign_within(election, 1000, 5)
            election._keep_alive_task.cancel()  # the fake clock alone decides here
            now[0] += 1.9
            assert election.is_leader()
            now[0] += 0.1  # 2.0 s = half of 4 s since the last refresh was sent
            assert not election.is_leader()
            now[0] -= 1.0
            assert not election.is_leader()  # lost is lost, even if the clock looked younger
        finally:
            await election.close()

    run(scenario())


def test_a_deleted_leader_key_is_lost_leadership(etcd) -> None:
    prefix = "/t-deleted"

    async def scenario():
        election = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            await campaign_within(election, 1000, 5)
            host, port = etcd.endpoint.split(":")
            async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
                await client.delete(EtcdKeys(prefix).leader)
            deadline = time.monotonic() + 5
            while election.is_leader() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not election.is_leader()
        finally:
            await election.close()

    run(scenario())


def test_a_malformed_leader_record_is_skipped_but_still_holds_the_key(etcd) -> None:
    prefix = "/t-malformed"

    async def scenario():
        host, port = etcd.endpoint.split(":")
        async with aetcd.Client(host=host, port=int(port), timeout=2) as client:
            await client.put(EtcdKeys(prefix).leader, b"{not json")
        assert (await read_cluster(etcd.endpoint, prefix))[0] is None
        election = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S)
        try:
            # The key is taken (by something that is not a leader record): no one leads.
            with pytest.raises(TimeoutError):
                await campaign_within(election, 1000, 0.5)
            assert election.leader() is None and not election.is_leader()
        finally:
            await election.close()

    run(scenario())


def test_a_campaign_whose_answer_comes_too_late_leads_with_the_key_it_created(etcd, monkeypatch) -> None:
    """The campaign's transaction commits in etcd, but its answer comes after the request
    timeout: the retry finds the key held by the replica's own lease, and the replica leads
    with that key's create revision (not a standby that keeps the key alive for good)."""
    prefix = "/t-late-answer"
    request_s = 0.5
    transaction = aetcd.Client.transaction
    num_late = [1]

    async def late_transaction(client, *args, **kwargs):
        result = await transaction(client, *args, **kwargs)  # committed
        if num_late[0]:
            num_late[0] -= 1
            await asyncio.sleep(4 * request_s)  # a slow network, a long pause: the answer is late
        return result

    monkeypatch.setattr(aetcd.Client, "transaction", late_transaction)

    async def scenario():
        first = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S, request_timeout_s=request_s)
        second = EtcdElection(etcd.endpoint, prefix=prefix, lease_ttl_s=TTL_S, request_timeout_s=request_s)
        try:
            info = await campaign_within(first, 1000, 5)
            assert num_late == [0] and first.is_leader() and info.peer_port == 1000
            kv = await raw_get(etcd.endpoint, EtcdKeys(prefix).leader)
            assert kv.create_revision == info.epoch and kv.lease == first._lease.id
            # Another candidate sees it as the leader and waits.
            standby = asyncio.create_task(second.campaign(addresses(2000)))
            await asyncio.sleep(0.5)
            assert not standby.done() and second.leader() == info
            standby.cancel()
        finally:
            await first.close()
            await second.close()

    run(scenario())


def test_unreachable_etcd_is_a_clear_bounded_error() -> None:
    endpoint = f"127.0.0.1:{closed_port()}"
    started = time.monotonic()
    with pytest.raises(EtcdUnreachable, match=f"no etcd answers within 1 s: {endpoint}"):
        run(EtcdElection(endpoint, lease_ttl_s=TTL_S, request_timeout_s=1.0).campaign(addresses(1000)), 10)
    with pytest.raises(EtcdUnreachable):
        run(read_cluster(endpoint, request_timeout_s=1.0), 10)
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("bad", ["", "localhost", "host:port", "host:0", "host:70000"])
def test_bad_endpoints_are_refused(bad) -> None:
    with pytest.raises(ValueError):
        EtcdElection(bad)


def test_a_lease_shorter_than_etcd_grants_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 2 s"):
        EtcdElection("127.0.0.1:2379", lease_ttl_s=1)
