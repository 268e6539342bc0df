"""Leader election of gManager replicas through etcd, for replicas on several hosts.

The scheme of etcd's own ``concurrency/election.go``:

* each replica holds a lease (``lease_ttl_s``), refreshed a quarter TTL after the last
  successful refresh; a failed refresh is tried again within half a second, so one slow or
  lost answer does not use up the half-TTL margin below;
* a campaign is one transaction: *if the leader key was never created (create revision 0),
  put it with my lease*; else read who holds it. A key found held by this replica's own lease
  is its own put from an attempt whose answer came too late: it committed, so the replica
  leads with that key;
* the winner's epoch is the key's create revision. etcd revisions only grow, so a later
  leader's epoch is larger, and instances can fence off commands of any earlier one;
* a standby watches the key (a watch from before its first transaction, so a deletion in
  between is not missed) and tries again when it is deleted: the leader resigned (revoked
  its lease) or died (the lease expired after its TTL). The watch wait is also bounded by the
  TTL, so a broken watch stream delays a takeover, never stops it;
* a leader whose lease was not refreshed for half its TTL no longer leads
  (:meth:`EtcdElection.is_leader` is false): it may have been paused or cut off while the lease
  ran out and another replica took over. Half the TTL leaves the other half as margin before
  etcd can let a successor in;
* a leader whose watch stream broke checks, when it reads the key again, that the key is still
  the one it created (same create revision); if it went or was created again meanwhile, it no
  longer leads.

All calls are bounded by ``request_timeout_s`` (a lease refresh also by a quarter TTL). An
etcd that does not answer at the start is an
:class:`~infinite_llm.daemon.etcd_discovery.EtcdUnreachable` error; later failures are retried
(a standby keeps campaigning, a leader loses its lease and steps down), and a call that fails
because the member in use is down or cut off moves the connection to the next endpoint that
answers (:class:`~infinite_llm.daemon.etcd_discovery.EtcdConnection`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict
from typing import Callable, Iterable

from infinite_llm.daemon.etcd_discovery import (
    DEFAULT_LEASE_TTL_S,
    DEFAULT_PREFIX,
    DEFAULT_REQUEST_TIMEOUT_S,
    EtcdConnection,
    EtcdKeys,
    decode_leader,
    wait_ended,
    encode_leader,
    error_text,
    lease_ttl_seconds,
    parse_endpoints,
    with_timeout,
)
from infinite_llm.scheduler.election import CandidateAddresses, LeaderInfo

log = logging.getLogger(__name__)

# Pause before trying a failed lease refresh again, s: short, so that a refresh lost in a blip
# is retried well within the half-TTL margin, yet not a busy loop while etcd is down.
REFRESH_RETRY_S = 0.5


class EtcdElection:
    """Election on the key ``<prefix>/gmanager/leader`` of an etcd cluster.

    Implements :class:`~infinite_llm.scheduler.election.Election`. ``clock`` is a monotonic
    clock in seconds (tests may pass their own).
    """

    def __init__(self, endpoints: str | Iterable[str], prefix: str = DEFAULT_PREFIX,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S, request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # host:port strings, checked now: a typo is a start-up error, not a campaign that waits
        self.endpoints = tuple(f"{host}:{port}" for host, port in parse_endpoints(endpoints))
        self.keys = EtcdKeys(prefix)
        self.lease_ttl_s = lease_ttl_seconds(lease_ttl_s)  # whole seconds
        self.request_timeout_s = request_timeout_s  # each etcd request, s
        self.clock = clock
        self._connection = EtcdConnection(self.endpoints, request_timeout_s)
        self._lease = None
        self._lease_refreshed_at = -float("inf")  # clock time a successful refresh was sent, s
        self._info: LeaderInfo | None = None  # ours, while we lead
        self._lost_reason: str | None = None  # why we stopped leading, once we have
        self._seen: LeaderInfo | None = None  # the leader key as last read or watched
        self._key_revision = 0  # etcd revision of the last change of the leader key we know of
        self._key_changed = asyncio.Event()
        self._keep_alive_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._revoke_task: asyncio.Task | None = None

    # ---- the Election interface ----------------------------------------------------------
    async def campaign(self, addresses: CandidateAddresses) -> LeaderInfo:
        if self._info is not None:  # a second campaign starts from nothing held
            self.resign()
        await self._connection.open()
        if self._watch_task is None or self._watch_task.done():
            watch_ready = asyncio.get_running_loop().create_future()
            self._watch_task = asyncio.create_task(self._watch(watch_ready), name="etcd-leader-watch")
            await with_timeout(asyncio.shield(watch_ready), 2 * self.request_timeout_s)
        record = LeaderInfo(epoch=0, pid=os.getpid(), **asdict(addresses))
        retry_s = min(1.0, self.lease_ttl_s / 4)
        while True:
            client = self._connection.client
            try:
                await self._ensure_lease(client)
                revision = await self._try_to_lead(client, record)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  etcd restarting, a lease gone: try again
                log.warning("campaign attempt failed: %s", error_text(exc))
                await self._connection.recover(client, exc)
                await asyncio.sleep(retry_s)
                continue
            if self._info is not None:
                return self._info
            await self._wait_for_change(after_revision=revision)

    def is_leader(self) -> bool:
        """Leading, the key not lost, and the lease refreshed within the last half TTL."""
        if self._info is None or self._lost_reason is not None:
            return False
        age_s = self.clock() - self._lease_refreshed_at
        if age_s >= self.lease_ttl_s / 2:
            self._lose(f"the lease was last refreshed {age_s:.1f} s ago, over half its {self.lease_ttl_s} s TTL")
            return False
        return True

    def resign(self) -> None:
        """Stop leading now; the lease is revoked in the background (``close`` waits for it).

        Revoking the lease deletes the leader key at once, so a standby's watch fires without
        waiting for the TTL.
        """
        self._info = None
        if self._keep_alive_task is not None:
            self._keep_alive_task.cancel()
            self._keep_alive_task = None
        lease, self._lease = self._lease, None
        if lease is None or self._connection.client is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop to revoke from: the key goes when the lease expires
        self._revoke_task = loop.create_task(self._revoke(lease.id), name="etcd-revoke")

    def leader(self) -> LeaderInfo | None:
        if self._info is not None:
            return self._info
        return self._seen

    async def close(self) -> None:
        """Resign if still holding a lease, wait for the revocation (bounded), disconnect."""
        self.resign()
        if self._watch_task is not None:
            self._watch_task.cancel()
        # The revocation is bounded by request_timeout_s; the cancelled watch ends at once, or
        # with the client's close (a stream that never answers its cancellation).
        await wait_ended((self._revoke_task, self._watch_task), self.request_timeout_s + 1.0)
        self._watch_task = self._revoke_task = None
        await self._connection.close()

    # ---- inside ------------------------------------------------------------------------------
    def _lose(self, reason: str) -> None:
        if self._info is not None and self._lost_reason is None:
            self._lost_reason = reason
            log.error("no longer leading with epoch %d: %s", self._info.epoch, reason)

    async def _try_to_lead(self, client, record: LeaderInfo) -> int:
        """One transaction; returns its revision. Sets ``_info`` when this replica won."""
        key = self.keys.leader
        tx = client.transactions
        succeeded, responses = await with_timeout(client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, encode_leader(record), lease=self._lease.id)],
            failure=[tx.get(key)]), self.request_timeout_s)
        if succeeded:
            # A put that creates a key does so at the transaction's revision: the create revision.
            epoch = responses[0].response_put.header.revision
            self._won(record, epoch)
            return epoch
        found = responses[0]
        if not found:  # deleted between the compare and the read: cannot happen in one txn
            return 0
        _, current = found[0]
        if current.lease == self._lease.id:
            # Our own put, from an attempt whose answer came after request_timeout_s: it was
            # committed all the same. Only this replica puts with its lease, so it leads, with
            # the key's create revision; waiting as a standby would keep the key alive with
            # the lease's refreshes and leave the cluster leaderless for good.
            log.warning("found the leader key held by our own lease %x: an earlier attempt committed",
                        self._lease.id)
            self._won(record, current.create_revision)
            return current.header.revision
        self._seen = decode_leader(current.value, current.create_revision)
        return current.header.revision

    def _won(self, record: LeaderInfo, epoch: int) -> None:
        self._info = LeaderInfo(**{**asdict(record), "epoch": epoch})
        self._lost_reason = None
        self._seen = self._info
        log.info("won the election: epoch %d, lease %x of %d s", epoch, self._lease.id, self.lease_ttl_s)

    async def _wait_for_change(self, after_revision: int) -> None:
        """Until the watch reports a change of the leader key after ``after_revision``, or a TTL."""
        deadline = self.clock() + self.lease_ttl_s
        while self._key_revision <= after_revision:
            remaining_s = deadline - self.clock()
            if remaining_s <= 0:
                return
            self._key_changed.clear()
            try:
                await asyncio.wait_for(self._key_changed.wait(), timeout=remaining_s)
            except TimeoutError:
                return

    async def _ensure_lease(self, client) -> None:
        if self._lease is not None:
            return
        if self._keep_alive_task is not None:
            self._keep_alive_task.cancel()
        sent_at = self.clock()
        self._lease = await with_timeout(client.lease(self.lease_ttl_s), self.request_timeout_s)
        self._lease_refreshed_at = sent_at
        self._keep_alive_task = asyncio.create_task(self._keep_alive(self._lease), name="etcd-keep-alive")

    async def _keep_alive(self, lease) -> None:
        """Refresh a quarter TTL after the last successful refresh, and within REFRESH_RETRY_S
        after a failed one; a refresh etcd answers with TTL 0 means the lease is gone.

        Each refresh waits at most a quarter TTL, so that a lost answer leaves room for another
        try before :meth:`is_leader` gives up at half the TTL.
        """
        interval_s = self.lease_ttl_s / 4
        refresh_timeout_s = min(self.request_timeout_s, interval_s)
        due_at = self._lease_refreshed_at + interval_s  # clock time of the next refresh, s
        while True:
            await asyncio.sleep(max(0.0, due_at - self.clock()))
            client = self._connection.client
            sent_at = self.clock()
            try:
                reply = await with_timeout(client.refresh_lease(lease.id), refresh_timeout_s)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  is_leader turns false once refreshes stay away
                timed_out = isinstance(exc, TimeoutError)
                reason = f"no answer within {refresh_timeout_s:g} s" if timed_out else error_text(exc)
                log.warning("refresh of lease %x failed: %s", lease.id, reason)
                await self._connection.recover(client, exc)
                # Counted from when the failed one was sent: after a timeout, which has waited
                # already, the next one goes at once.
                due_at = sent_at + REFRESH_RETRY_S
                continue
            if reply is None or reply.TTL <= 0:
                self._lose(f"etcd says lease {lease.id:x} expired")
                if self._lease is lease:
                    self._lease = None  # a standby campaigns with a new one
                return
            self._lease_refreshed_at = sent_at
            due_at = sent_at + interval_s

    async def _watch(self, ready: asyncio.Future) -> None:
        """Keep ``_seen`` and ``_key_revision`` current; a broken stream is read afresh."""
        from aetcd.rtypes import EventKind

        key = self.keys.leader
        while True:
            client = self._connection.client
            try:
                # A range read of the one key: its revision is known even when the key is missing.
                snapshot = await with_timeout(client.get_range(key, key + b"\0"), self.request_timeout_s)
                revision = snapshot.header.revision
                current = next((kv for kv in snapshot if kv.key == key), None)
                self._check_still_ours(current, revision)
                if current is not None:
                    self._seen = self._info or decode_leader(current.value, current.create_revision)
                else:
                    self._seen = self._info
                self._note_change(revision)
                watch = await with_timeout(client.watch(key, start_revision=revision + 1), self.request_timeout_s)
                if not ready.done():
                    ready.set_result(None)
                async for event in watch:
                    kv = event.kv
                    if event.kind == EventKind.DELETE:
                        self._seen = None
                        if self._info is not None:
                            self._lose("the leader key was deleted")
                    else:
                        self._seen = decode_leader(kv.value, kv.create_revision)
                        if self._info is not None and kv.create_revision != self._info.epoch:
                            self._lose(f"the leader key was created again at revision {kv.create_revision}")
                    self._note_change(kv.mod_revision)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  etcd restarting: read again shortly
                log.warning("watch of the leader key broke: %s", error_text(exc))
                if not ready.done():
                    ready.set_exception(exc)
                    return
                await self._connection.recover(client, exc)
            # A watch that ended without an error was closed with its client (a reconnect).
            await asyncio.sleep(min(1.0, self.request_timeout_s))

    def _check_still_ours(self, current, revision: int) -> None:
        """While leading, lose leadership when a read of the leader key at ``revision`` finds it
        gone or created by someone else: changes made while the watch stream was down are
        seen only by this read."""
        if self._info is None or revision < self._info.epoch:
            return  # not leading, or a read from before this replica's key existed
        if current is None:
            self._lose("the leader key was deleted")
        elif current.create_revision != self._info.epoch:
            self._lose(f"the leader key was created again at revision {current.create_revision}")

    def _note_change(self, revision: int) -> None:
        self._key_revision = max(self._key_revision, revision)
        self._key_changed.set()

    async def _revoke(self, lease_id: int) -> None:
        try:
            await with_timeout(self._connection.client.revoke_lease(lease_id), self.request_timeout_s)
        except Exception as exc:  # noqa: BLE001  the key then goes when the lease expires
            # After a lost lease this is the expected answer ("lease not found"): nothing to undo.
            log.info("lease %x not revoked: %s", lease_id, error_text(exc))
