"""Discovery through etcd: where the gManager leader and the instances are, for several hosts.

Key layout under a prefix (default ``/infinite-llm``; one prefix per cluster sharing an etcd):

* ``<prefix>/gmanager/leader``: the leader's addresses and pid as JSON, attached to the
  leader's lease. The key's create revision is the leader's epoch (it is not in the value, so
  it cannot disagree with it): etcd numbers revisions in one increasing sequence, so a key
  created later has a larger create revision.
* ``<prefix>/members/<inst_id>``: one :class:`~.membership.Member` as JSON, attached to the
  instance's lease. A killed instance stops refreshing its lease, etcd deletes the key when
  the lease expires, and every watcher sees it go.

Every call to etcd is bounded (``request_timeout_s``): an unreachable etcd is an
:class:`EtcdUnreachable` error naming the endpoints, never a hang. The daemons' clients
(:class:`EtcdConnection`) move to another endpoint when the member in use fails. Records that do not parse
are skipped (and logged once per key and revision), as the local membership skips
half-written files.

:class:`EtcdMembership` has the methods of :class:`~.membership.LocalMembership`
(``publish``/``withdraw``/``members``) plus ``leader()``, all synchronous and non-blocking:
a background task keeps a copy of the prefix current through a watch, and writes what was
published. ``start()`` and ``close()`` bracket its life on the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from infinite_llm.scheduler.election import LeaderInfo

from .membership import Member

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "/infinite-llm"
DEFAULT_LEASE_TTL_S = 10  # etcd counts lease time-to-live in whole seconds
DEFAULT_REQUEST_TIMEOUT_S = 2.0
# etcd refuses a lease shorter than its minimum (1.5 times the election timeout: 2 s with the
# defaults) by raising the TTL it grants; asking for less is a configuration mistake.
MIN_LEASE_TTL_S = 2
_LEADER_FIELDS = ("pid", "peer_host", "peer_port", "http_port", "socket_path")
# gRPC shares connections among channels to the same address, with their reconnection
# backoff (up to two minutes): a new client after a restarted etcd would still wait it out.
# Each client gets its own connection, retried within a second.
_CHANNEL_OPTIONS = {"grpc.use_local_subchannel_pool": 1, "grpc.initial_reconnect_backoff_ms": 200,
                    "grpc.max_reconnect_backoff_ms": 1000}


class EtcdUnreachable(ConnectionError):
    """No etcd endpoint answered within the bounded wait."""


def parse_endpoints(endpoints: str | Iterable[str]) -> tuple[tuple[str, int], ...]:
    """``"h1:2379,h2:2379"`` or a list of ``host:port`` strings, as (host, port) pairs.

    An ``http://`` scheme is accepted and dropped (etcd's own flags carry one). Raises
    ValueError on an empty list or an entry without a valid port.
    """
    items = endpoints.split(",") if isinstance(endpoints, str) else list(endpoints)
    parsed = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        address = item.removeprefix("http://")
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"etcd endpoint must be host:port, got {item!r}")
        parsed.append((host.strip("[]"), int(port)))
    if not parsed:
        raise ValueError("no etcd endpoint given")
    return tuple(parsed)


def lease_ttl_seconds(ttl_s: float) -> int:
    """A lease time-to-live as etcd takes it: whole seconds, rounded up, at least the minimum."""
    if not (math.isfinite(ttl_s) and ttl_s >= MIN_LEASE_TTL_S):
        raise ValueError(f"an etcd lease lasts at least {MIN_LEASE_TTL_S} s, got {ttl_s}")
    return math.ceil(ttl_s)


@dataclass(frozen=True)
class EtcdKeys:
    """Where a cluster's records live in etcd."""

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        if not self.prefix.startswith("/") or self.prefix.endswith("/"):
            raise ValueError(f"etcd prefix must start with '/' and not end with one, got {self.prefix!r}")

    @property
    def root(self) -> bytes:
        """Every key of the cluster starts with this (the range one watch covers)."""
        return f"{self.prefix}/".encode()

    @property
    def leader(self) -> bytes:
        return f"{self.prefix}/gmanager/leader".encode()

    @property
    def members(self) -> bytes:
        return f"{self.prefix}/members/".encode()

    def member(self, inst_id: int) -> bytes:
        return self.members + str(inst_id).encode()


# ---- records -------------------------------------------------------------------------------
def encode_leader(info: LeaderInfo) -> bytes:
    """The leader key's value: everything but the epoch, which is the key's create revision."""
    record = asdict(info)
    del record["epoch"]
    return json.dumps(record).encode()


def decode_leader(value: bytes, create_revision: int) -> LeaderInfo | None:
    """The leader record, or None for a value that is not one (skipped, never trusted)."""
    try:
        record = json.loads(value)
        info = LeaderInfo(epoch=int(create_revision), **{name: record[name] for name in _LEADER_FIELDS})
    except (ValueError, TypeError, KeyError):
        return None
    if not (isinstance(info.pid, int) and isinstance(info.peer_host, str) and isinstance(info.peer_port, int)
            and isinstance(info.http_port, int) and isinstance(info.socket_path, str)) or info.epoch <= 0:
        return None
    return info


def encode_member(member: Member) -> bytes:
    return json.dumps(asdict(member)).encode()


def decode_member(value: bytes) -> Member | None:
    """A member record, or None for a value that is not one."""
    try:
        member = Member(**json.loads(value))
    except (ValueError, TypeError):
        return None
    ints = (member.inst_id, member.pid, member.peer_port, member.http_port, member.num_blocks_total,
            member.num_blocks_free)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) or not isinstance(member.peer_host, str):
        return None
    if not isinstance(member.socket_path, str) or not isinstance(member.draining, bool):
        return None
    if isinstance(member.updated_at, bool) or not isinstance(member.updated_at, (int, float)):
        return None
    return member


# ---- connecting ----------------------------------------------------------------------------
async def connect(endpoints: str | Iterable[str], request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S):
    """An ``aetcd.Client`` on the first endpoint that answers a status request in time.

    Every later request of the client is bounded by ``request_timeout_s`` too (seconds).
    Raises EtcdUnreachable when none answers.
    """
    client, _ = await _first_answering(parse_endpoints(endpoints), request_timeout_s)
    return client


async def _first_answering(endpoints: Iterable[tuple[str, int]], request_timeout_s: float):
    """(client, (host, port)) of the first of ``endpoints`` that answers a status request within
    ``request_timeout_s``, tried in order; EtcdUnreachable naming each one's error otherwise."""
    import aetcd  # the local single-machine default does not need it

    errors = []
    for host, port in endpoints:
        client = aetcd.Client(host=host, port=port, timeout=request_timeout_s, options=_CHANNEL_OPTIONS)
        try:
            async with asyncio.timeout(request_timeout_s):
                await client.status()
        except (TimeoutError, aetcd.ClientError) as exc:
            errors.append(f"{host}:{port}: {error_text(exc)}")
            await close_client(client, request_timeout_s)
            continue
        except BaseException:  # cancelled: leave no channel open behind
            await close_client(client, request_timeout_s)
            raise
        return client, (host, port)
    raise EtcdUnreachable(f"no etcd answers within {request_timeout_s:g} s: {'; '.join(errors)}")


async def wait_ended(tasks: Iterable[asyncio.Task], timeout_s: float) -> None:
    """Wait, at most ``timeout_s``, for tasks that were cancelled or bound their own work to
    end. A task cancelled inside an aetcd watch may wait on the stream's own cancellation,
    which a half-broken connection never answers; closing the client afterwards ends it."""
    tasks = [t for t in tasks if t is not None]
    if not tasks:
        return
    _done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        log.warning("etcd task %s did not end within %g s of its cancellation: left to the client's close",
                    task.get_name(), timeout_s)


def error_text(exc: BaseException) -> str:
    """The first line of an error's message, or its type when it has none (a timeout)."""
    text = str(exc)
    return text.splitlines()[0] if text.strip() else type(exc).__name__


def is_connection_failure(exc: BaseException) -> bool:
    """Whether a failed call says the endpoint is down, cut off or too slow, so another member
    may answer, rather than that etcd refused the request itself."""
    import aetcd

    # etcd answers "unavailable" also when the member lost its quorum or its raft leader.
    return isinstance(exc, (TimeoutError, aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError))


class EtcdConnection:
    """A client on one member of an etcd cluster, moved to another member when calls fail.

    An ``aetcd.Client`` talks to a single endpoint for its whole life. A cluster of three
    members keeps its quorum and its data when one of them dies, so the users of this
    connection call :meth:`reconnect` after a call failed with :func:`is_connection_failure`:
    it tries the endpoints in order, starting after the one in use and ending with it (a
    fresh channel there also skips gRPC's reconnection backoff). Leases and keys live in the
    cluster, not in the connection; only watches must be opened again on the new client.
    """

    def __init__(self, endpoints: str | Iterable[str], request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.request_timeout_s = request_timeout_s  # each status request while connecting, s
        self.client = None  # the aetcd.Client in use; None before open and after close
        self.endpoint: tuple[str, int] | None = None  # (host, port) of the member in use
        self._reconnecting = asyncio.Lock()
        self._num_reconnects = 0  # attempts finished, successful or not

    async def open(self) -> None:
        """Connect to the first endpoint that answers; EtcdUnreachable when none does."""
        if self.client is None:
            self.client, self.endpoint = await _first_answering(self.endpoints, self.request_timeout_s)

    async def reconnect(self, failed_client) -> None:
        """Replace ``failed_client`` by a client on the next endpoint that answers.

        Does nothing when another task replaced it or tried to while this one waited: each
        failing call does not add a round of probes. Bounded by ``request_timeout_s`` per
        endpoint; raises EtcdUnreachable when none answers, keeping the client in use.
        """
        num_reconnects_seen = self._num_reconnects
        async with self._reconnecting:
            if (failed_client is not self.client or self.client is None
                    or self._num_reconnects != num_reconnects_seen):
                return
            start = self.endpoints.index(self.endpoint) + 1
            order = self.endpoints[start:] + self.endpoints[:start]
            try:
                client, endpoint = await _first_answering(order, self.request_timeout_s)
            finally:
                self._num_reconnects += 1
            old_client, self.client, self.endpoint = self.client, client, endpoint
            if len(self.endpoints) > 1:
                log.warning("etcd connection moved to %s:%d", *endpoint)
        # Closing the old client ends its watches, so their owners open them again here.
        await close_client(old_client, self.request_timeout_s)

    async def recover(self, failed_client, error: BaseException) -> None:
        """After a call on ``failed_client`` failed with ``error``: reconnect if the error says
        the member is out of reach. An unreachable cluster is logged; the caller retries."""
        if not is_connection_failure(error):
            return
        try:
            await self.reconnect(failed_client)
        except EtcdUnreachable as exc:
            log.warning("%s", exc)

    async def close(self) -> None:
        if self.client is not None:
            client, self.client = self.client, None
            await close_client(client, self.request_timeout_s)


async def read_cluster(endpoints: str | Iterable[str], prefix: str = DEFAULT_PREFIX,
                       request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> tuple[LeaderInfo | None, dict[int, Member]]:
    """One read of the leader and the members, for clients that do not stay (``infctl``)."""
    keys = EtcdKeys(prefix)
    client = await connect(endpoints, request_timeout_s)
    try:
        snapshot = await with_timeout(client.get_prefix(keys.root), request_timeout_s)
        leader, members = _split(keys, snapshot)
        return leader, members
    finally:
        await close_client(client, request_timeout_s)


def _split(keys: EtcdKeys, kvs: Iterable[Any]) -> tuple[LeaderInfo | None, dict[int, Member]]:
    leader = None
    members: dict[int, Member] = {}
    for kv in kvs:
        if kv.key == keys.leader:
            leader = decode_leader(kv.value, kv.create_revision)
            if leader is None:
                log.warning("skipped a malformed leader record at %s", kv.key.decode(errors="replace"))
        elif kv.key.startswith(keys.members):
            member = decode_member(kv.value)
            if member is None or keys.member(member.inst_id) != kv.key:
                log.warning("skipped a malformed member record at %s", kv.key.decode(errors="replace"))
                continue
            members[member.inst_id] = member
    return leader, members


async def with_timeout(awaitable, timeout_s: float):
    """``await awaitable``, or TimeoutError after ``timeout_s`` seconds."""
    async with asyncio.timeout(timeout_s):
        return await awaitable


async def close_client(client, timeout_s: float) -> None:
    """Close an etcd client within ``timeout_s`` seconds; a failure to close is not an error."""
    try:
        await with_timeout(client.close(), timeout_s)
    except Exception:  # noqa: BLE001  closing a broken channel may fail; nothing is left to do
        pass


# ---- membership -----------------------------------------------------------------------------
class EtcdMembership:
    """Membership and leader lookup in etcd, with the interface of the local membership.

    ``publish`` and ``withdraw`` return at once; the background task writes the latest record
    under this process's lease (granted on the first publish, kept alive every third of its
    TTL). ``members`` and ``leader`` read the copy that a watch on the cluster's prefix keeps
    current. An instance whose lease expired while it could not reach etcd (a long pause, a
    partition) gets a new lease and publishes again. A call that fails because the etcd member
    in use is down or cut off moves the connection to the next endpoint that answers.
    """

    def __init__(self, endpoints: str | Iterable[str], prefix: str = DEFAULT_PREFIX,
                 lease_ttl_s: float = DEFAULT_LEASE_TTL_S,
                 request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.endpoints = parse_endpoints(endpoints)
        self.keys = EtcdKeys(prefix)
        self.lease_ttl_s = lease_ttl_seconds(lease_ttl_s)  # whole seconds
        self.request_timeout_s = request_timeout_s  # each etcd request, s
        self._connection = EtcdConnection(endpoints, request_timeout_s)
        self._lease = None
        # time.monotonic() until which the lease surely lives: its last grant or refresh was
        # sent then less its TTL ago. Past it, etcd may have deleted this instance's record.
        self._lease_good_until = 0.0
        self._members: dict[int, Member] = {}
        self._leader: LeaderInfo | None = None
        self._pending: Member | None = None  # the newest record not yet written
        self._published: Member | None = None
        self._withdrawn: set[int] = set()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        """Connect and read the current state (bounded); then keep it current in the background.

        Raises EtcdUnreachable when no endpoint answers, or when the one that answered the
        connection's status request does not answer the read (a member cut off from its
        cluster's quorum answers the first, not the second).
        """
        await self._connection.open()
        try:
            snapshot = await with_timeout(self._connection.client.get_prefix(self.keys.root), self.request_timeout_s)
        except Exception as exc:
            if not is_connection_failure(exc):
                raise
            host, port = self._connection.endpoint
            reason = "" if isinstance(exc, TimeoutError) else f": {error_text(exc)}"
            raise EtcdUnreachable(f"no answer from etcd {host}:{port} within {self.request_timeout_s:g} s "
                                  f"reading {self.keys.prefix}{reason}") from exc
        self._leader, self._members = _split(self.keys, snapshot)
        self._tasks = [asyncio.create_task(self._watch(snapshot.header.revision + 1), name="etcd-watch"),
                       asyncio.create_task(self._write(), name="etcd-write")]

    async def close(self) -> None:
        """Stop the background work and revoke the lease, which deletes this process's record."""
        for task in self._tasks:
            task.cancel()
        await wait_ended(self._tasks, self.request_timeout_s)
        self._tasks = []
        client = self._connection.client
        if client is None:
            return
        if self._lease is not None:
            try:
                await with_timeout(client.revoke_lease(self._lease.id), self.request_timeout_s)
            except Exception as exc:  # noqa: BLE001  the record then goes when the lease expires
                log.warning("could not revoke the membership lease: %s", error_text(exc))
            self._lease = None
        await self._connection.close()

    def publish(self, member: Member) -> None:
        self._withdrawn.discard(member.inst_id)
        self._pending = member
        self._wake.set()

    async def wait_published(self, inst_id: int, timeout_s: float) -> bool:
        """Whether ``inst_id``'s record is in etcd within ``timeout_s``: ``publish`` only hands it
        to the writer task, which puts it under the lease."""
        deadline = time.monotonic() + timeout_s
        while self._published is None or self._published.inst_id != inst_id:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.01)
        return True

    def withdraw(self, inst_id: int) -> None:
        self._withdrawn.add(inst_id)
        if self._pending is not None and self._pending.inst_id == inst_id:
            self._pending = None
        self._wake.set()

    def registered(self) -> bool:
        """Whether this instance's record surely stands: its lease was granted or refreshed less
        than a TTL ago. Cut off from etcd (a partition) it is not, once a TTL has passed: the
        others no longer see it, and it takes no new work."""
        return time.monotonic() < self._lease_good_until

    def members(self) -> dict[int, Member]:
        """Live members by instance id (those whose lease has not expired)."""
        return dict(self._members)

    def leader(self) -> LeaderInfo | None:
        """The gManager leader as the leader key names it, or None when there is none."""
        return self._leader

    # ---- background ---------------------------------------------------------------------
    async def _watch(self, start_revision: int) -> None:
        """Apply every change under the prefix; after a broken stream, read afresh and go on."""
        retry_s = min(1.0, self.request_timeout_s)
        while True:
            client = self._connection.client
            try:
                if start_revision is None:
                    snapshot = await with_timeout(client.get_prefix(self.keys.root), self.request_timeout_s)
                    self._leader, self._members = _split(self.keys, snapshot)
                    start_revision = snapshot.header.revision + 1
                watch = await with_timeout(client.watch_prefix(self.keys.root, start_revision=start_revision),
                                       self.request_timeout_s)
                async for event in watch:
                    self._apply(event)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  etcd restarting or unreachable: read again later
                log.warning("etcd watch on %s broke: %s", self.keys.prefix, error_text(exc))
                await self._connection.recover(client, exc)
            # A watch that ended without an error was closed with its client (a reconnect).
            start_revision = None
            await asyncio.sleep(retry_s)

    def _apply(self, event) -> None:
        from aetcd.rtypes import EventKind

        kv = event.kv
        deleted = event.kind == EventKind.DELETE
        if kv.key == self.keys.leader:
            self._leader = None if deleted else decode_leader(kv.value, kv.create_revision)
            if not deleted and self._leader is None:
                log.warning("skipped a malformed leader record at %s", kv.key.decode(errors="replace"))
            return
        if not kv.key.startswith(self.keys.members):
            return
        suffix = kv.key[len(self.keys.members):]
        if deleted:
            if suffix.isdigit():
                self._members.pop(int(suffix), None)
            return
        member = decode_member(kv.value)
        if member is None or self.keys.member(member.inst_id) != kv.key:
            log.warning("skipped a malformed member record at %s", kv.key.decode(errors="replace"))
            if suffix.isdigit():
                self._members.pop(int(suffix), None)
            return
        self._members[member.inst_id] = member

    async def _write(self) -> None:
        """Write the newest published record and keep the lease alive; a failed write is tried
        again within a second, on another member if the one in use is out of reach."""
        refresh_s = self.lease_ttl_s / 3
        retry_s = min(1.0, refresh_s)
        wait_s = refresh_s
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=wait_s)
            except TimeoutError:
                pass
            self._wake.clear()
            client = self._connection.client
            try:
                await self._write_once(client)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001  the record expires if this goes on for a TTL
                log.warning("etcd membership update failed: %s", error_text(exc))
                await self._connection.recover(client, exc)
                wait_s = retry_s
            else:
                wait_s = refresh_s

    async def _write_once(self, client) -> None:
        timeout_s = self.request_timeout_s
        for inst_id in sorted(self._withdrawn):
            await with_timeout(client.delete(self.keys.member(inst_id)), timeout_s)
            self._withdrawn.discard(inst_id)
            if self._published is not None and self._published.inst_id == inst_id:
                self._published = None
        if self._lease is not None:
            sent_at = time.monotonic()
            reply = await with_timeout(client.refresh_lease(self._lease.id), timeout_s)
            if reply is not None and reply.TTL > 0:
                self._lease_good_until = sent_at + reply.TTL
            else:
                self._lease_good_until = 0.0
                # Expired (this process was paused or cut off for a TTL): etcd deleted the
                # record with it. A new lease, and the record again.
                log.warning("the membership lease expired: registering again")
                self._lease = None
                if self._pending is None:
                    self._pending = self._published
        member, self._pending = self._pending, None
        if member is None:
            return
        try:
            if self._lease is None:
                sent_at = time.monotonic()
                self._lease = await with_timeout(client.lease(self.lease_ttl_s), timeout_s)
                self._lease_good_until = sent_at + self.lease_ttl_s
            await with_timeout(client.put(self.keys.member(member.inst_id), encode_member(member), lease=self._lease.id),
                           timeout_s)
        except BaseException:
            if self._pending is None:  # nothing newer came meanwhile: try this one again
                self._pending = member
            raise
        self._published = member
