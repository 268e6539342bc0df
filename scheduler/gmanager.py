"""The gManager service: heartbeats in, placement plans out, ``MoveKV`` commands to instances.

Three layers, from pure to I/O:

* :class:`ClusterView` (pure, no clock, no I/O): the soft state built from heartbeats: each
  instance's pool figures, batch and versioned placement. A new leader starts empty and
  rebuilds it from the next heartbeats (it answers ``needs_full_placement`` to every diff it
  has no base for). It turns into a :class:`~.policy.ClusterSnapshot` for the policy.
* :class:`GManager`: the daemon. A UCX listener serves Heartbeats; a periodic loop plans with
  :func:`~.policy.plan` and sends each move as ``MoveKV`` stamped with the leader's epoch; an
  admin HTTP API (Unix socket and TCP) reports status, runs a rebalance on demand and drains
  an instance (planned by :func:`~.drain.plan_drain`, sent and re-planned until it is empty).
* :func:`main`: argparse, campaign, serve while leading, step down, SIGTERM.

Every ``MoveKV`` goes to the request's home, which alone may switch its block table: a move of
its own pool's blocks, or of a segment a creditor holds to another creditor (the home forwards
it, see ``docs/daemon.md``). The policy plans only moves from the home's pool; a drain
(:mod:`.drain`) plans both kinds.

Peer addresses come from the membership, where every ``infinited`` publishes its UCX listener
(heartbeats do not carry them): the local folder ``<state_dir>/members``, or etcd's
``<prefix>/members/`` when ``--etcd-endpoints`` is given, in which case the election goes
through etcd too (:mod:`.etcd_election`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import grp
import ipaddress
import itertools
import json
import logging
import math
import os
import signal
import socket
import stat
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Collection

from aiohttp import web

from infinite_llm.daemon.etcd_discovery import (
    EtcdKeys,
    EtcdMembership,
    EtcdUnreachable,
    lease_ttl_seconds,
    parse_endpoints,
)
from infinite_llm.daemon.admin_token import bearer_matches, read_admin_token
from infinite_llm.daemon.membership import LocalMembership
from infinite_llm.scheduler.drain import (
    DrainEntry,
    DrainFigures,
    DrainInstance,
    DrainMove,
    DrainPlan,
    DrainRefused,
    DrainSnapshot,
    UnknownInstance,
    drain_figures,
    plan_drain,
)
from infinite_llm.scheduler.election import CandidateAddresses, Election, LeaderInfo, LocalElection
from infinite_llm.scheduler.etcd_election import EtcdElection
from infinite_llm.scheduler.perf_model import PerfModel, load_model
from infinite_llm.scheduler.remote_overhead import RemoteOverheadWindow
from infinite_llm.scheduler.policy import (
    ClusterSnapshot,
    InstanceState,
    PlacementTable,
    Thresholds,
    plan,
)
from infinite_llm.scheduler.policy import RequestPlacementEntry as PolicyEntry
from infinite_llm.transport.errors import PeerUnreachable, RemoteError, RequestTimeout
from infinite_llm.transport.interface import PeerAddress, TransportConfig
from infinite_llm.transport.messages import (
    Ack,
    CreditorHint,
    Drain,
    Heartbeat,
    HeartbeatReply,
    Message,
    MoveKV,
    PoolFigures,
    Uncordon,
)
from infinite_llm.transport.placement import PlacementGap, VersionedPlacement, apply_heartbeat

log = logging.getLogger("infinite_llm.gmanager")

EXIT_LOST_LEADERSHIP = 3  # the process stepped down: a supervisor restarts it as a standby

# At a stop, how long the admin API waits for the requests in progress to end (aiohttp's default
# is 60 s, past systemd's TimeoutStopSec=30): a slow client's upload, or a rebalance waiting for a
# MoveKV's commit. aiohttp then cancels them, waiting as long again for one that does not end at
# once, so the API is shut within twice this. Idle keep-alive connections are closed at once.
HTTP_SHUTDOWN_S = 5.0


# ---- soft state (pure) ----------------------------------------------------------------------
class HeartbeatRefused(ValueError):
    """A heartbeat that cannot describe a real instance; nothing of it is kept."""


@dataclass(frozen=True)
class InstanceRecord:
    """One instance as its heartbeats describe it."""

    inst_id: int
    seq: int  # of the last heartbeat taken
    pool: PoolFigures  # blocks
    batch_size: int  # running requests
    placement: VersionedPlacement  # where this instance's requests' blocks are
    heard_at_s: float  # the gManager's monotonic clock at the last heartbeat, s


@dataclass(frozen=True)
class HeartbeatOutcome:
    acked_placement_version: int  # 0: nothing held for the sender
    needs_full_placement: bool


class ClusterView:
    """Soft state of the cluster, from heartbeats. Time is passed in (``now_s``, monotonic)."""

    def __init__(self, silent_after_s: float) -> None:
        self.silent_after_s = silent_after_s  # an instance unheard for longer is left out, s
        self.records: dict[int, InstanceRecord] = {}
        self.num_heartbeats = 0
        self.num_refused = 0
        self.num_gaps = 0

    def receive(self, heartbeat: Heartbeat, now_s: float) -> HeartbeatOutcome:
        """Take a heartbeat. Raises HeartbeatRefused (counted) when it is impossible or stale."""
        try:
            self._check(heartbeat)
        except HeartbeatRefused:
            self.num_refused += 1
            raise
        held = self.records.get(heartbeat.inst_id)
        base = held.placement if held is not None else VersionedPlacement(0, {})
        try:
            placement = apply_heartbeat(base, heartbeat)
            needs_full = False
        except PlacementGap:
            # The figures are still current; the placement stays as last known until the
            # instance sends it in full.
            self.num_gaps += 1
            placement, needs_full = base, True
        if not needs_full:  # a stale placement may not match the new figures: not checked
            try:
                _check_placement(heartbeat, placement)
            except HeartbeatRefused:
                self.num_refused += 1
                raise
        self.num_heartbeats += 1
        self.records[heartbeat.inst_id] = InstanceRecord(
            heartbeat.inst_id, heartbeat.seq, heartbeat.pool, heartbeat.batch_size, placement, now_s)
        return HeartbeatOutcome(placement.version, needs_full)

    def _check(self, hb: Heartbeat) -> None:
        pool = hb.pool
        if hb.inst_id <= 0:
            raise HeartbeatRefused(f"instance id must be positive, got {hb.inst_id}")
        if min(pool.num_blocks_total, pool.num_blocks_free, pool.num_blocks_lent, pool.num_blocks_borrowed,
               hb.batch_size) < 0:
            raise HeartbeatRefused(f"instance {hb.inst_id}: negative pool figures or batch size")
        if pool.num_blocks_free + pool.num_blocks_lent > pool.num_blocks_total:
            raise HeartbeatRefused(f"instance {hb.inst_id}: {pool.num_blocks_free} free + {pool.num_blocks_lent} "
                                   f"lent blocks exceed the pool's {pool.num_blocks_total}")
        held = self.records.get(hb.inst_id)
        # A restarted instance numbers from 1 again; it starts with its full placement.
        if held is not None and hb.seq <= held.seq and hb.placement_base_version != 0:
            raise HeartbeatRefused(f"instance {hb.inst_id}: heartbeat {hb.seq} is not newer than {held.seq}")
        for entry in hb.placement_upserts:
            if entry.num_blocks <= 0:
                raise HeartbeatRefused(f"instance {hb.inst_id}: request {entry.req_id} has {entry.num_blocks} blocks")
            if entry.local != (entry.inst_id == hb.inst_id):
                raise HeartbeatRefused(f"instance {hb.inst_id}: request {entry.req_id} on instance {entry.inst_id} "
                                       f"marked local={entry.local}")

    def live(self, now_s: float) -> list[InstanceRecord]:
        """Instances heard from within ``silent_after_s``, by id."""
        return [r for _, r in sorted(self.records.items()) if now_s - r.heard_at_s <= self.silent_after_s]

    def forget_silent(self, now_s: float) -> list[int]:
        """Drop instances silent for longer than ``silent_after_s``; returns their ids."""
        gone = [i for i, r in self.records.items() if now_s - r.heard_at_s > self.silent_after_s]
        for inst_id in gone:
            del self.records[inst_id]
        return gone

    def snapshot(self, now_s: float, block_size: int) -> tuple[ClusterSnapshot, list[tuple[int, int]]]:
        """The live instances and their requests' placement, as the policy takes them.

        Request ids are unique per home only, so the policy sees each request under its index
        in the returned list of ``(home_inst_id, req_id)``. Blocks a home reports on an
        instance that is not live are left out: the policy could not move them and refuses a
        snapshot naming an unknown instance.
        """
        live = self.live(now_s)
        live_ids = {r.inst_id for r in live}
        instances = tuple(InstanceState(r.inst_id, r.pool.num_blocks_total, r.pool.num_blocks_free) for r in live)
        requests: dict[tuple[int, int], int] = {}
        entries = []
        for record in live:
            for e in record.placement.entries.values():
                if e.inst_id in live_ids:
                    index = requests.setdefault((record.inst_id, e.req_id), len(requests))
                    entries.append(PolicyEntry(index, e.inst_id, e.num_blocks, e.local, e.movable))
        return ClusterSnapshot(block_size, instances, PlacementTable.from_entries(entries)), list(requests)

    def creditor_hints(self, now_s: float, exclude_inst_id: int, num_hints: int,
                       skip: Collection[int] = frozenset()) -> tuple[CreditorHint, ...]:
        """The live instances with the most free blocks (ties: lower id), the asker and those in
        ``skip`` (draining ones) left out."""
        candidates = [r for r in self.live(now_s) if r.inst_id != exclude_inst_id and r.inst_id not in skip
                      and r.pool.num_blocks_free > 0]
        candidates.sort(key=lambda r: (-r.pool.num_blocks_free, r.inst_id))
        return tuple(CreditorHint(r.inst_id, r.pool.num_blocks_free) for r in candidates[:num_hints])


def _check_placement(hb: Heartbeat, placement: VersionedPlacement) -> None:
    """The home's blocks placed on itself must fit in what its pool has in use."""
    local_blocks = sum(e.num_blocks for e in placement.entries.values() if e.local)
    in_use = hb.pool.num_blocks_total - hb.pool.num_blocks_free - hb.pool.num_blocks_lent
    if local_blocks > in_use:
        raise HeartbeatRefused(f"instance {hb.inst_id}: placement holds {local_blocks} local blocks "
                               f"but only {in_use} are in use by its own requests")


def role_of(pool: PoolFigures) -> str:
    """Debtor: some of its requests' KV is elsewhere; creditor: it holds KV for others."""
    if pool.num_blocks_borrowed and pool.num_blocks_lent:
        return "debtor+creditor"
    if pool.num_blocks_borrowed:
        return "debtor"
    if pool.num_blocks_lent:
        return "creditor"
    return "none"


# ---- the service ------------------------------------------------------------------------------
@dataclass(frozen=True)
class GManagerConfig:
    state_dir: Path  # shared with the instances: election files and membership
    perf_model_path: Path  # a fitted model saved by perf_model.save_model
    peer_host: str = "127.0.0.1"  # UCX listener for heartbeats
    peer_port: int = 0  # 0: any free port
    http_host: str = "127.0.0.1"  # admin API on TCP
    http_port: int = 0  # 0: any free port
    socket_path: Path | None = None  # admin API on a Unix socket; None: <state_dir>/gmanager/<pid>.sock
    # The socket's group (mode 0660, for operators in it: the admin group); None: the process's,
    # with its umask's mode.
    socket_gid: int | None = None
    # A request over TCP must carry ``Authorization: Bearer <admin_token>``; None: TCP is open
    # to whoever reaches the port (keep http_host on the loopback or a management network).
    admin_token: str | None = None
    heartbeat_interval_s: float = 1.0  # how often instances send heartbeats, s
    silent_after_heartbeats: int = 5  # heartbeat periods of silence before an instance is left out
    plan_interval_s: float = 2.0  # between policy rounds, s
    block_size: int = 16  # tokens per KV block, as the instances are configured
    debtor_max_batch: int = 32  # an instance with a smaller batch may lend out its requests' KV
    creditor_max_used_fraction: float = 0.9  # an instance with less memory in use may take KV
    max_moves_per_round: int = 16
    move_timeout_s: float = 60.0  # a MoveKV is answered once committed at a step boundary, s
    # Connecting to an instance, s: an instance answers a connection between engine steps, and
    # one CPU prefill step can last over a second.
    connect_timeout_s: float = 5.0
    num_creditor_hints: int = 3  # creditors named in each heartbeat reply
    election_poll_s: float = 0.2  # how often a standby retries for leadership, s
    etcd_endpoints: tuple[str, ...] = ()  # host:port of etcd: election and membership there; empty: state_dir
    etcd_prefix: str = "/infinite-llm"  # the cluster's keys in etcd, as the instances are configured
    etcd_lease_ttl_s: float = 10.0  # the leader's lease: a dead leader is replaced within this, s
    etcd_request_s: float = 2.0  # one request to etcd, the first connection included, s
    # The policy's remote-attention overhead is learnt from the heartbeats of this last window
    # (s; 0 keeps the calibrated one): the instances report their waits for creditors' parts.
    remote_overhead_window_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("heartbeat_interval_s", "plan_interval_s", "move_timeout_s", "connect_timeout_s", "election_poll_s",
                     "etcd_request_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be positive, got {value}")
        if self.etcd_endpoints:
            parse_endpoints(self.etcd_endpoints)
            lease_ttl_seconds(self.etcd_lease_ttl_s)
            EtcdKeys(self.etcd_prefix)
        for name in ("silent_after_heartbeats", "block_size", "max_moves_per_round"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.num_creditor_hints < 0:
            raise ValueError(f"num_creditor_hints must be >= 0, got {self.num_creditor_hints}")
        if not (math.isfinite(self.remote_overhead_window_s) and self.remote_overhead_window_s >= 0):
            raise ValueError(f"remote_overhead_window_s must be >= 0, got {self.remote_overhead_window_s}")

    @property
    def thresholds(self) -> Thresholds:
        return Thresholds(debtor_max_batch=self.debtor_max_batch,
                          creditor_max_used_fraction=self.creditor_max_used_fraction,
                          max_moves=self.max_moves_per_round)


@dataclass
class RoundStats:
    """Counters of the periodic loop and of the moves sent."""

    num_rounds: int = 0
    num_round_errors: int = 0
    last_round_s: float = 0.0  # wall time of the last round, s
    last_error: str = ""
    moves: Counter = field(default_factory=Counter)  # result -> number of moves


class NotLeader(Exception):
    """A command that only the leader carries out reached a standby."""


class InconsistentState(Exception):
    """The soft state cannot be planned from (heartbeats of a move in flight disagree)."""


class MovesUnsettled(InconsistentState):
    """Moves were sent that the heartbeats do not show yet: a plan now would move the same
    blocks again."""


class CommandFailed(Exception):
    """An instance did not take a command (unreachable, no answer, or a refusal)."""


class AdminSocketInUse(Exception):
    """The admin socket's path is taken: another process answers on it, or it is no socket."""


@dataclass
class DrainState:
    """One drain the leader runs: the moves sent and how far it has come."""

    inst_id: int  # the drained instance
    drain_id: int  # unique per epoch, carried by Drain and Uncordon
    started_s: float  # the gManager's monotonic clock when the instance took the Drain, s
    # "draining", then "safe_to_stop"; "stopped" (it left holding nothing for others) or "lost"
    # (it went silent holding some)
    state: str = "draining"
    own_blocks: bool = True  # its own requests' blocks move too (False: only what it holds for others)
    num_rounds: int = 0  # plans made from heartbeats newer than the previous moves
    # The moves of the latest round that sent any, with their results; earlier rounds only in
    # the counters: a drain that retries a refused move every heartbeat for hours must not grow
    # its report with each try.
    moves: list[dict[str, Any]] = field(default_factory=list)
    move_results: Counter = field(default_factory=Counter)  # (kind, result) -> moves sent, all rounds
    figures: DrainFigures | None = None  # at the last round
    last_error: str = ""  # why the last round could not plan, if it could not
    task: asyncio.Task | None = None


@dataclass(frozen=True)
class PlannedMove:
    """A policy move, named as instances name requests (``req_id`` is unique per home)."""

    home_inst_id: int  # the request's home
    req_id: int  # the home's request id
    src_inst_id: int  # holds the blocks now: the home, or a creditor (drain moves)
    dst_inst_id: int  # the creditor
    num_blocks: int  # blocks
    predicted_gain: float  # cluster decode throughput gained, tokens/s


class GManager:
    """One gManager replica: serves heartbeats and commands while it leads."""

    def __init__(self, config: GManagerConfig, model: PerfModel, election: Election,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.model = model  # as calibrated; the policy uses ``model_now`` (with the measured overhead)
        self.remote_overhead = (RemoteOverheadWindow(config.remote_overhead_window_s)
                                if config.remote_overhead_window_s > 0 else None)
        self.election = election
        self.clock = clock
        self.view = ClusterView(silent_after_s=config.silent_after_heartbeats * config.heartbeat_interval_s)
        self.membership: LocalMembership | EtcdMembership
        if config.etcd_endpoints:  # where the instances publish themselves, as the election goes
            self.membership = EtcdMembership(config.etcd_endpoints, prefix=config.etcd_prefix,
                                             lease_ttl_s=config.etcd_lease_ttl_s,
                                             request_timeout_s=config.etcd_request_s)
        else:
            self.membership = LocalMembership(config.state_dir, stale_after_s=config.silent_after_heartbeats
                                              * config.heartbeat_interval_s)
        self.leadership: LeaderInfo | None = None
        self.stats = RoundStats()
        self.transport = None
        self.http_port = 0
        self.socket_path = config.socket_path or config.state_dir / "gmanager" / f"{os.getpid()}.sock"
        self._move_ids = itertools.count(1)
        self._round_lock = asyncio.Lock()  # the loop and on-demand rebalances do not interleave
        self._stopping = asyncio.Event()
        # Instances that moves (of rounds and drains) touched, and when the last of them ended;
        # and those with a move under way. Planning waits for their next heartbeat, or it would
        # plan again from figures that predate the moves.
        self._moved_at_s: dict[int, float] = {}
        self._moves_in_flight: Counter = Counter()  # instance id -> moves under way touching it
        self._drains: dict[int, DrainState] = {}  # instance id -> its drain, while cordoned
        self._drain_ids = itertools.count(1)
        # Instance id -> the lock held across "is it drained?", the Drain or Uncordon command
        # and the registration that follows: two requests at once would otherwise both send
        # Drain and both start a drain loop. One small lock per instance ever drained.
        self._drain_locks: dict[int, asyncio.Lock] = {}
        self._socket_file: tuple[int, int] | None = None  # (st_dev, st_ino) of the socket bound

    @property
    def epoch(self) -> int:
        return self.leadership.epoch if self.leadership is not None else 0

    # ---- life ----------------------------------------------------------------------------
    async def run(self) -> int:
        """Start listening, campaign, serve while leading; returns the exit code.

        First SIGTERM (or SIGINT): stop, resign, exit 0. A second one exits at once.
        """
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._on_signal)
        loop.add_signal_handler(signal.SIGINT, self._on_signal)
        runners: list[web.AppRunner] = []
        tasks: list[asyncio.Task] = []
        exit_code = 0
        try:
            await self._start_transport()
            runners = await self._start_http()
            await self.membership.start()
            addresses = CandidateAddresses(self.transport.address.host, self.transport.address.port,
                                           self.http_port, str(self.socket_path))
            log.info("gManager pid %d standing by: peers at %s, HTTP on %s:%d, socket %s", os.getpid(),
                     self.transport.address, self.config.http_host, self.http_port, self.socket_path)
            campaign = asyncio.create_task(self.election.campaign(addresses), name="campaign")
            stop = asyncio.create_task(self._stopping.wait(), name="stop")
            tasks = [campaign, stop]
            await asyncio.wait([campaign, stop], return_when=asyncio.FIRST_COMPLETED)
            if self._stopping.is_set():
                return 0
            self.leadership = campaign.result()
            log.info("leading with epoch %d", self.epoch)
            tasks += [asyncio.create_task(self._plan_loop(), name="plan"),
                      asyncio.create_task(self._watch_leadership(), name="leadership")]
            done, _ = await asyncio.wait(tasks[1:], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop and task.exception() is not None:
                    raise task.exception()
            if not self._stopping.is_set():
                exit_code = EXIT_LOST_LEADERSHIP
            return exit_code
        finally:
            # Drains end with the leadership: a successor resumes one when asked again.
            tasks += [d.task for d in self._drains.values() if d.task is not None]
            self._drains.clear()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if exit_code != EXIT_LOST_LEADERSHIP:
                self.election.resign()
            self.leadership = None
            await self.election.close()
            await self.membership.close()
            for runner in runners:
                await runner.cleanup()
            self._remove_own_socket()
            if self.transport is not None:
                await self.transport.close()
            log.info("gManager stopped")

    def _on_signal(self) -> None:
        if self._stopping.is_set():
            log.warning("second stop signal: exiting now")
            os._exit(1)
        log.info("stop signal: resigning")
        self._stopping.set()

    async def _watch_leadership(self) -> None:
        while self.election.is_leader():
            await asyncio.sleep(self.config.election_poll_s)
        # The lock file is gone (local), or the lease went unrefreshed for half its TTL or the
        # key was deleted (etcd): another replica may lead already.
        log.error("lost leadership of epoch %d: stepping down", self.epoch)

    async def _start_transport(self) -> None:
        from infinite_llm.transport.ucx import UcxTransport

        self.transport = UcxTransport(TransportConfig(host=self.config.peer_host, port=self.config.peer_port,
                                                      connect_timeout_s=self.config.connect_timeout_s,
                                                      request_timeout_s=self.config.move_timeout_s,
                                                      # Heartbeats and commands: no bulk to share.
                                                      shared_memory_bytes=0))
        await self.transport.start(self.handle)

    async def _start_http(self) -> list[web.AppRunner]:
        await self._claim_socket_path()
        # No handler_cancellation: a drain or rebalance whose client gave up runs to its end,
        # rather than stop between a Drain sent and its registration, say.
        runner = web.AppRunner(AdminApp(self, self.config.admin_token).build(), shutdown_timeout=HTTP_SHUTDOWN_S)
        await runner.setup()
        await web.UnixSite(runner, str(self.socket_path)).start()
        if self.config.socket_gid is not None:
            # Connecting needs write access: the admin group's members get it, nobody else.
            os.chown(self.socket_path, -1, self.config.socket_gid)
            os.chmod(self.socket_path, 0o660)
        bound = os.lstat(self.socket_path)
        self._socket_file = (bound.st_dev, bound.st_ino)
        site = web.TCPSite(runner, self.config.http_host, self.config.http_port)
        await site.start()
        self.http_port = site._server.sockets[0].getsockname()[1]
        if self.config.admin_token is None and not _is_loopback(self.config.http_host):
            log.warning("the admin API on %s:%d takes drains and rebalances from anyone who reaches it: "
                        "give --admin-token-file", self.config.http_host, self.http_port)
        return [runner]

    async def _claim_socket_path(self) -> None:
        """Make way for the admin socket: a socket nobody answers on was left by a killed
        process and is removed; a socket another process answers on (a live replica given the
        same ``--socket-path``) or a file that is no socket is left alone, and the replica
        does not start (AdminSocketInUse)."""
        path = self.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise AdminSocketInUse(f"socket path {path} exists and is not a socket; not removed")
        try:
            _, writer = await asyncio.wait_for(asyncio.open_unix_connection(str(path)), timeout=2.0)
        except ConnectionRefusedError:
            path.unlink(missing_ok=True)
            return
        except FileNotFoundError:  # removed meanwhile
            return
        except (OSError, TimeoutError) as err:
            raise AdminSocketInUse(f"socket path {path} cannot be checked ({err}); not removed") from None
        writer.close()
        raise AdminSocketInUse(f"socket path {path} is in use: another process (a running gManager?) answers "
                               f"on it; give each replica its own --socket-path")

    def _remove_own_socket(self) -> None:
        """Unlink the admin socket if the file at its path is still the one this replica bound;
        another process's socket there (made after this one was taken for dead) stays."""
        if self._socket_file is None:
            return
        try:
            found = os.lstat(self.socket_path)
        except FileNotFoundError:
            return
        if (found.st_dev, found.st_ino) == self._socket_file:
            self.socket_path.unlink(missing_ok=True)
        self._socket_file = None

    # ---- heartbeats --------------------------------------------------------------------------
    async def handle(self, message: Message) -> Message | None:
        """The UCX handler. Exceptions become ErrorReply for the sender."""
        if not isinstance(message, Heartbeat):
            raise ValueError(f"the gManager does not serve {message.TYPE}")
        if self.leadership is None or not self.election.is_leader():
            raise NotLeader(f"pid {os.getpid()} does not lead; heartbeats go to the published leader")
        now_s = self.clock()
        try:
            outcome = self.view.receive(message, now_s)
        except HeartbeatRefused as refused:
            log.warning("heartbeat refused: %s", refused)
            raise
        if self.remote_overhead is not None:
            self.remote_overhead.add(now_s, message.remote_wait_us, message.remote_waits, message.attend_serve_us,
                                     message.attend_serves)
        # A draining instance takes no blocks: it is never named as a creditor.
        hints = self.view.creditor_hints(now_s, message.inst_id, self.config.num_creditor_hints,
                                         skip=self.draining_instances())
        return HeartbeatReply(epoch=self.epoch, acked_placement_version=outcome.acked_placement_version,
                              needs_full_placement=outcome.needs_full_placement, creditors=hints)

    # ---- planning and moving ---------------------------------------------------------------
    def model_now(self, now_s: float) -> PerfModel:
        """The calibrated model with the remote-attention overhead the instances report, once
        the window holds enough of it: a move that splits a request is worth what a split
        request costs on this cluster, not on the calibration run."""
        measured = self.remote_overhead.estimate_s(now_s) if self.remote_overhead is not None else None
        if measured is None:
            return self.model
        return dataclasses.replace(self.model, remote_overhead_s=measured)

    async def _plan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.plan_interval_s)
            if self.moves_settled():
                await self._timed_step("round", lambda: self.rebalance(dry_run=False))
            await self._timed_step("forget", self._forget_silent)
            await self._timed_step("drains", self._resume_returned_drains)

    async def _timed_step(self, name: str, step: Callable[[], Any]) -> None:
        """One step of the loop: its errors are logged and counted, never stop the loop."""
        started = time.perf_counter()
        try:
            result = step()
            if asyncio.iscoroutine(result):
                await result
        except MovesUnsettled as exc:  # a drain sent moves since the loop checked: no error
            log.debug("%s step skipped: %s", name, exc)
        except Exception as exc:
            self.stats.num_round_errors += 1
            self.stats.last_error = f"{name}: {exc}"
            if isinstance(exc, InconsistentState):  # heartbeats taken at different moments: the next round retries
                log.warning("%s step skipped: %s", name, exc)
            else:
                log.exception("%s step failed", name)
        finally:
            elapsed = time.perf_counter() - started
            if name == "round":
                self.stats.last_round_s = elapsed
            if elapsed > self.config.plan_interval_s:
                log.warning("%s step took %.3f s, longer than the plan interval", name, elapsed)

    async def _forget_silent(self) -> None:
        for inst_id in self.view.forget_silent(self.clock()):
            log.warning("instance %d silent for %.1f s: left out", inst_id, self.view.silent_after_s)
            # A drained instance that stopped is done with; if it comes back, it is not cordoned.
            drain = self._drains.pop(inst_id, None)
            if drain is not None and drain.task is not None:
                drain.task.cancel()
            self._moved_at_s.pop(inst_id, None)

    def unsettled_instances(self) -> list[int]:
        """Instances with a move under way, or moved since their last heartbeat (silent ones
        aside), by id."""
        live = {r.inst_id: r for r in self.view.live(self.clock())}
        moved = {inst_id for inst_id, moved_at in self._moved_at_s.items()
                 if inst_id in live and live[inst_id].heard_at_s <= moved_at}
        return sorted(moved | set(self._moves_in_flight))

    def moves_settled(self) -> bool:
        """Every instance that moves touched has sent a heartbeat since they ended (or gone silent)."""
        return not self.unsettled_instances()

    async def rebalance(self, dry_run: bool) -> dict[str, Any]:
        """One policy round: plan from the soft state, and unless ``dry_run`` send the moves.

        Returns the epoch and the moves in plan order, each with its predicted gain (cluster
        decode tokens/s) and, when sent, its result. Unless ``dry_run``, raises MovesUnsettled
        while earlier moves (of a round or a drain) are under way or not yet reported by the
        instances they touched.
        """
        if self.leadership is None or not self.election.is_leader():
            raise NotLeader(f"pid {os.getpid()} is a standby; only the leader plans")
        async with self._round_lock:
            unsettled = [] if dry_run else self.unsettled_instances()
            if unsettled:
                raise MovesUnsettled(
                    f"earlier moves are under way or not yet in the heartbeats of instance(s) "
                    f"{', '.join(map(str, unsettled))}: a round now would move the same blocks again; "
                    f"retry after their next heartbeat")
            snapshot, requests = self.view.snapshot(self.clock(), self.config.block_size)
            draining = self.draining_instances()
            if draining:  # a draining instance offers no room: the policy places nothing there
                snapshot = dataclasses.replace(snapshot, instances=tuple(
                    dataclasses.replace(i, free_blocks=0) if i.inst_id in draining else i
                    for i in snapshot.instances))
            try:
                planned = plan(snapshot, self.model_now(self.clock()), self.config.thresholds)
            except ValueError as err:
                raise InconsistentState(f"the heartbeats disagree, no plan until they settle: {err}") from err
            moves = [PlannedMove(*requests[m.req_id], m.src_inst, m.dst_inst, m.num_blocks, m.predicted_gain)
                     for m in planned]
            results = ["not_sent"] * len(moves) if dry_run else await self._send_moves(moves)
            if not dry_run:
                self.stats.num_rounds += 1
        return {
            "epoch": self.epoch,
            "dry_run": dry_run,
            "moves": [{"req_id": m.req_id, "home_inst_id": m.home_inst_id, "src_inst_id": m.src_inst_id,
                       "dst_inst_id": m.dst_inst_id, "num_blocks": m.num_blocks,
                       "predicted_gain_tokens_per_s": m.predicted_gain, "result": r}
                      for m, r in zip(moves, results)],
        }

    async def _send_moves(self, moves: list[PlannedMove]) -> list[str]:
        """Send each move to its source; a source's moves in plan order, sources in parallel."""
        members = self.membership.members()
        by_source: dict[int, list[int]] = {}
        for index, move in enumerate(moves):
            by_source.setdefault(move.src_inst_id, []).append(index)
        results = ["not_sent"] * len(moves)

        async def send_all_of(indices: list[int]) -> None:
            async for position, result in self._send_in_order([moves[i] for i in indices], members):
                results[indices[position]] = result

        await asyncio.gather(*(send_all_of(i) for i in by_source.values()))
        for result in results:
            self.stats.moves[result] += 1
        return results

    async def _send_in_order(self, moves: list[PlannedMove], members: dict) -> AsyncIterator[tuple[int, str]]:
        """Send moves that go to one instance one after another; yields each one's position in
        ``moves`` and result as it comes."""
        unanswered = False
        for position, move in enumerate(moves):
            # A move may wait a long time for its commit: leadership is checked before each, so
            # that a replica that lost it meanwhile sends nothing more.
            if not self.election.is_leader():
                yield position, "not_leader"
            # An instance that did not answer would hold the round (and its lock) for another
            # move_timeout_s per move: the rest of its moves wait for the next plan.
            elif unanswered:
                yield position, "skipped"
            else:
                result = await self._send_move(move, members)
                unanswered = result in ("timeout", "unreachable")
                yield position, result

    async def _send_move(self, move: PlannedMove, members: dict) -> str:
        # The home carries out every move of its request's blocks: only it switches its table.
        member = members.get(move.home_inst_id)
        if member is None:
            log.warning("no address for instance %d: move of request %d not sent", move.home_inst_id, move.req_id)
            return "no_address"
        command = MoveKV(epoch=self.epoch, move_id=next(self._move_ids), home_inst_id=move.home_inst_id,
                         req_id=move.req_id, src_inst_id=move.src_inst_id, dst_inst_id=move.dst_inst_id,
                         num_blocks=move.num_blocks)
        peer = PeerAddress(member.peer_host, member.peer_port)
        touched = {move.home_inst_id, move.src_inst_id, move.dst_inst_id}
        self._moves_in_flight.update(touched)
        try:
            reply = await self.transport.request(peer, command, timeout_s=self.config.move_timeout_s)
        except RemoteError as err:
            log.warning("move %d refused by instance %d: %s", command.move_id, move.home_inst_id, err.detail)
            return "refused"
        except RequestTimeout:
            log.warning("move %d: no answer from instance %d", command.move_id, move.home_inst_id)
            return "timeout"
        except PeerUnreachable as err:
            log.warning("move %d: instance %d unreachable: %s", command.move_id, move.home_inst_id, err.detail)
            return "unreachable"
        finally:
            self._move_ended(touched)
        if not isinstance(reply, Ack):
            log.warning("move %d: unexpected reply %s", command.move_id, reply.TYPE)
            return "refused"
        log.info("move %d committed: %d blocks of request %d from %d to %d", command.move_id, move.num_blocks,
                 move.req_id, move.src_inst_id, move.dst_inst_id)
        return "committed"

    def _move_ended(self, touched: set[int]) -> None:
        """Whatever its result (a move that timed out may still commit), the figures of the
        instances a move touched are stale until their next heartbeat."""
        ended_s = self.clock()
        for inst_id in touched:
            self._moves_in_flight[inst_id] -= 1
            if self._moves_in_flight[inst_id] <= 0:
                del self._moves_in_flight[inst_id]
            self._moved_at_s[inst_id] = ended_s  # the clock is monotonic: the latest move wins

    # ---- drain -------------------------------------------------------------------------------
    def draining_instances(self) -> set[int]:
        """Instances that take no blocks: those this leader drains, and those whose membership
        record says they drain. A new leader knows of no drain of its predecessor's (``_drains``
        ends with the leadership), but the instance stays cordoned and says so in its record, as
        does an instance that is stopping."""
        draining = set(self._drains)
        draining.update(inst_id for inst_id, member in self.membership.members().items() if member.draining)
        return draining

    def _drain_snapshot(self, now_s: float) -> DrainSnapshot:
        live = self.view.live(now_s)
        draining = self.draining_instances()
        instances = tuple(DrainInstance(r.inst_id, r.pool.num_blocks_free, r.pool.num_blocks_lent, r.batch_size,
                                        r.inst_id in draining) for r in live)
        entries = tuple(DrainEntry(r.inst_id, e.req_id, e.inst_id, e.num_blocks)
                        for r in live for e in r.placement.entries.values())
        return DrainSnapshot(instances, entries)

    async def drain(self, inst_id: int, dry_run: bool, own_blocks: bool = True) -> dict[str, Any]:
        """Cordon ``inst_id`` and move everything off it (with ``own_blocks`` False, only the
        segments it holds for other homes: an instance that stops asks for this); returns the
        drain's report.

        Raises UnknownInstance (no recent heartbeat), DrainRefused (the other instances lack
        room: nothing is sent and the instance stays as it was) and CommandFailed (the instance
        did not take the ``Drain``). A dry run returns the planned moves. A drain under way is
        reported, not started again (requests at once wait for one another: one drain runs); one
        whose loop ended is resumed where :meth:`_drain_to_resume` says so. The moves go on in
        the background, planned again from heartbeats newer than the last ones until nothing is
        left (:meth:`drain_status`).
        """
        if self.leadership is None or not self.election.is_leader():
            raise NotLeader(f"pid {os.getpid()} is a standby; only the leader drains")
        if dry_run:
            drain_plan = plan_drain(self._drain_snapshot(self.clock()), inst_id, own_blocks)
            return {"instance_id": inst_id, "epoch": self.epoch, "dry_run": True,
                    "moves": [_drain_move_json(m, "not_sent") for m in drain_plan.moves],
                    "num_blocks_held": drain_plan.num_blocks_held,
                    "num_blocks_own_movable": drain_plan.num_blocks_own_movable,
                    "num_blocks_free_elsewhere": drain_plan.num_blocks_free_elsewhere}
        async with self._drain_lock(inst_id):
            state = self._drains.get(inst_id)
            if state is not None:
                if self._drain_to_resume(state):
                    await self._resume_drain(state)
                return self.drain_status(inst_id)
            drain_plan = plan_drain(self._drain_snapshot(self.clock()), inst_id, own_blocks)
            drain_id = next(self._drain_ids)
            await self._command(inst_id, Drain(epoch=self.epoch, drain_id=drain_id, inst_id=inst_id))
            state = DrainState(inst_id, drain_id, self.clock(), own_blocks=own_blocks)
            self._drains[inst_id] = state
            log.info("draining instance %d: %d moves planned", inst_id, len(drain_plan.moves))
            self._start_drain_loop(state, drain_plan)
        return {**self.drain_status(inst_id), "planned_moves": [_drain_move_json(m, "not_sent")
                                                                for m in drain_plan.moves]}

    async def uncordon(self, inst_id: int) -> dict[str, Any]:
        """Call off a drain (if any) and let the instance admit requests and take blocks again."""
        if self.leadership is None or not self.election.is_leader():
            raise NotLeader(f"pid {os.getpid()} is a standby; only the leader uncordons")
        # A drain being started meanwhile is registered before this goes on: its loop is stopped.
        async with self._drain_lock(inst_id):
            state = self._drains.get(inst_id)
            if state is None and inst_id not in {r.inst_id for r in self.view.live(self.clock())}:
                raise UnknownInstance(f"unknown instance {inst_id} (no recent heartbeat)")
            await self._command(inst_id, Uncordon(epoch=self.epoch, drain_id=state.drain_id if state else 0,
                                                  inst_id=inst_id))
            if state is not None:
                del self._drains[inst_id]
                if state.task is not None:
                    state.task.cancel()
        return {"instance_id": inst_id, "draining": False}

    def _drain_lock(self, inst_id: int) -> asyncio.Lock:
        return self._drain_locks.setdefault(inst_id, asyncio.Lock())

    def _drain_to_resume(self, state: DrainState) -> bool:
        """Whether a drain whose loop has ended must run again. A drained instance that runs
        requests again restarted within ``--silent-after-heartbeats`` (so it was never
        forgotten), and a restart is not cordoned. One that went silent mid-drain ("lost", or
        "stopped") and heartbeats again before it was forgotten only stalled: it is still
        cordoned, and without a loop its drain would never end."""
        if state.task is not None and not state.task.done():
            return False
        if state.state == "safe_to_stop":
            return not self.drain_status(state.inst_id)["safe_to_stop"]
        live = {r.inst_id for r in self.view.live(self.clock())}
        return state.state in ("lost", "stopped") and state.inst_id in live

    async def _resume_drain(self, state: DrainState) -> None:
        """Cordon the instance again and restart its drain loop; the caller holds its drain lock."""
        await self._command(state.inst_id, Drain(epoch=self.epoch, drain_id=state.drain_id, inst_id=state.inst_id))
        log.info("drain of instance %d resumed (it was %s)", state.inst_id, state.state)
        state.state = "draining"
        state.last_error = ""
        # No plan yet: the next one is made from heartbeats newer than the Drain.
        self._start_drain_loop(state, None)

    def _start_drain_loop(self, state: DrainState, drain_plan: DrainPlan | None) -> None:
        """One loop per drain: a loop started before is cancelled (unless it is the caller)."""
        if state.task is not None and state.task is not asyncio.current_task():
            state.task.cancel()
        state.task = asyncio.create_task(self._drain_loop(state, drain_plan), name=f"drain-{state.inst_id}")

    def _resume_returned_drains(self) -> None:
        """A step of the periodic loop: resume, in the background, each drain that ended
        "lost" or "stopped" whose instance heartbeats again (see :meth:`_drain_to_resume`)."""
        for state in list(self._drains.values()):
            if state.state in ("lost", "stopped") and self._drain_to_resume(state):
                state.task = asyncio.create_task(self._resume_in_background(state), name=f"drain-{state.inst_id}")

    async def _resume_in_background(self, state: DrainState) -> None:
        async with self._drain_lock(state.inst_id):
            # Uncordoned, forgotten or resumed by a request while this waited: nothing to do.
            if self._drains.get(state.inst_id) is not state or state.state not in ("lost", "stopped"):
                return
            if not self.election.is_leader():
                return
            try:
                await self._resume_drain(state)
            except CommandFailed as err:  # the next round of the loop tries again
                state.last_error = str(err)
                log.warning("drain of instance %d not resumed: %s", state.inst_id, err)

    async def _command(self, inst_id: int, command: Message) -> None:
        member = self.membership.members().get(inst_id)
        if member is None:
            raise CommandFailed(f"no address for instance {inst_id} in the membership folder")
        try:
            await self.transport.request(PeerAddress(member.peer_host, member.peer_port), command,
                                         timeout_s=self.config.move_timeout_s)
        except RemoteError as err:
            raise CommandFailed(f"instance {inst_id} refused {command.TYPE}: {err.detail}") from None
        except (RequestTimeout, PeerUnreachable) as err:
            raise CommandFailed(f"instance {inst_id} did not answer {command.TYPE}: {err}") from None

    def drain_status(self, inst_id: int) -> dict[str, Any]:
        """Where the drain of ``inst_id`` stands; raises UnknownInstance for an instance neither
        live nor draining. ``safe_to_stop`` holds once a heartbeat of the instance newer than its
        last moves says it runs nothing and holds nothing for others, and no home places blocks
        there, for as long as the latest heartbeats still say so."""
        state = self._drains.get(inst_id)
        try:
            figures = drain_figures(self._drain_snapshot(self.clock()), inst_id)
        except UnknownInstance:
            if state is None:
                raise
            figures = state.figures
        # Draining: this leader drains it, or its membership record says it is cordoned (by an
        # earlier leader, or stopping), in which case ``state`` is "not_draining" (no drain of
        # this leader's: POST /v1/drain starts one).
        report: dict[str, Any] = {"instance_id": inst_id, "epoch": self.epoch,
                                  "draining": state is not None or inst_id in self.draining_instances()}
        if figures is not None:
            report.update(running_requests=figures.num_running, own_requests=figures.num_own_requests,
                          blocks_held_for_others=figures.num_blocks_held,
                          blocks_of_others_on_it=figures.num_blocks_on_it)
        if state is None:
            return {**report, "state": "not_draining", "safe_to_stop": False}
        # Reached once, but the instance may have restarted since and run requests again.
        safe_to_stop = state.state == "safe_to_stop" and figures is not None and figures.safe_to_stop
        phase = "draining" if state.state == "safe_to_stop" and not safe_to_stop else state.state
        return {**report, "drain_id": state.drain_id, "state": phase,
                "safe_to_stop": safe_to_stop, "rounds": state.num_rounds,
                "elapsed_s": self.clock() - state.started_s, "moves": list(state.moves),
                "move_results": _by_kind(state.move_results), "last_error": state.last_error}

    async def _drain_loop(self, state: DrainState, drain_plan: DrainPlan | None) -> None:
        """Send the plan; wait for heartbeats newer than the moves; plan again; until nothing is left."""
        period = self.config.heartbeat_interval_s
        while True:
            if not self.election.is_leader():  # the drain ends with the leadership (see run)
                log.warning("drain of instance %d stopped: leadership lost", state.inst_id)
                return
            try:
                moves = drain_plan.moves if drain_plan is not None else ()
                await self._send_drain_moves(state, moves)
                sent_s = self.clock()
                # The drained instance's next heartbeat is newer than the Drain too, so nothing
                # it admitted before the Drain goes unseen.
                involved = {state.inst_id} | {i for m in moves for i in (m.home_inst_id, m.dst_inst_id)}
                while True:
                    await asyncio.sleep(period / 4)
                    live = {r.inst_id: r for r in self.view.live(self.clock())}
                    if state.inst_id not in live:
                        left = state.figures
                        if left is not None and left.num_blocks_held == 0 and left.num_blocks_on_it == 0:
                            state.state = "stopped"
                            log.info("drain of instance %d: it stopped holding nothing for others", state.inst_id)
                        else:
                            state.state = "lost"
                            log.warning("drain of instance %d: the instance went silent", state.inst_id)
                        return
                    # Moves of a round (or of another drain) since: their figures are needed too.
                    if all(i not in live or live[i].heard_at_s > sent_s for i in involved) and self.moves_settled():
                        break
                snapshot = self._drain_snapshot(self.clock())
                state.figures = drain_figures(snapshot, state.inst_id)
                state.num_rounds += 1
                if state.figures.safe_to_stop:
                    state.state = "safe_to_stop"
                    log.info("instance %d is drained: safe to stop", state.inst_id)
                    return
                try:
                    drain_plan = plan_drain(snapshot, state.inst_id, state.own_blocks)
                    state.last_error = ""
                except DrainRefused as err:  # room may come back: keep trying
                    drain_plan, state.last_error = None, str(err)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # one bad round must not end the drain
                log.exception("drain of instance %d: round failed", state.inst_id)
                drain_plan, state.last_error = None, f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(period)

    async def _send_drain_moves(self, state: DrainState, moves: tuple[DrainMove, ...]) -> None:
        """Each move to its request's home; a home's moves in order, homes in parallel."""
        if not moves:
            return
        members = self.membership.members()
        by_home: dict[int, list[DrainMove]] = {}
        for move in moves:
            by_home.setdefault(move.home_inst_id, []).append(move)

        state.moves = []

        async def send_all_of(home_moves: list[DrainMove]) -> None:
            planned = [PlannedMove(m.home_inst_id, m.req_id, m.src_inst_id, m.dst_inst_id, m.num_blocks, 0.0)
                       for m in home_moves]
            async for position, result in self._send_in_order(planned, members):
                move = home_moves[position]
                state.moves.append(_drain_move_json(move, result))
                state.move_results[move.kind, result] += 1
                self.stats.moves[result] += 1

        await asyncio.gather(*(send_all_of(v) for v in by_home.values()))

    # ---- status ------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        now_s = self.clock()
        leader = self.leadership or self.election.leader()
        draining = self.draining_instances()
        instances = [self.instance_status(record, now_s, draining) for record in self.view.live(now_s)]
        return {
            "leader": self.leadership is not None,
            "pid": os.getpid(),
            "peer_address": str(self.transport.address) if self.transport is not None else None,
            "http_port": self.http_port,
            "epoch": self.epoch,
            "leader_pid": leader.pid if leader is not None else None,
            "leader_epoch": leader.epoch if leader is not None else None,
            "instances": instances,
            "heartbeats": {"taken": self.view.num_heartbeats, "refused": self.view.num_refused,
                           "placement_gaps": self.view.num_gaps},
            "rounds": {"completed": self.stats.num_rounds, "errors": self.stats.num_round_errors,
                       "last_round_s": self.stats.last_round_s, "last_error": self.stats.last_error},
            "moves": dict(self.stats.moves),
            "remote_overhead_s": {"calibrated": self.model.remote_overhead_s,
                                  "measured": (self.remote_overhead.estimate_s(now_s)
                                               if self.remote_overhead is not None else None),
                                  "window_s": self.config.remote_overhead_window_s},
        }

    def instance_status(self, record: InstanceRecord, now_s: float,
                        draining: Collection[int] | None = None) -> dict[str, Any]:
        """One instance's figures; ``draining`` (default: :meth:`draining_instances`) saves a
        read of the membership per instance."""
        pool = record.pool
        if draining is None:
            draining = self.draining_instances()
        return {
            "instance_id": record.inst_id,
            "num_blocks_total": pool.num_blocks_total,
            "num_blocks_free": pool.num_blocks_free,
            "pool_used_fraction": (1 - pool.num_blocks_free / pool.num_blocks_total) if pool.num_blocks_total else 0.0,
            "batch_size": record.batch_size,
            "role": role_of(pool),
            "num_blocks_lent": pool.num_blocks_lent,
            "num_blocks_borrowed": pool.num_blocks_borrowed,
            "placement_version": record.placement.version,
            "last_heartbeat_age_s": now_s - record.heard_at_s,
            "draining": record.inst_id in draining,
        }


def _drain_move_json(move: DrainMove, result: str) -> dict[str, Any]:
    return {"req_id": move.req_id, "home_inst_id": move.home_inst_id, "src_inst_id": move.src_inst_id,
            "dst_inst_id": move.dst_inst_id, "num_blocks": move.num_blocks, "kind": move.kind, "result": result}


def _by_kind(move_results: Counter) -> dict[str, dict[str, int]]:
    """``{(kind, result): n}`` as ``{kind: {result: n}}``."""
    out: dict[str, dict[str, int]] = {}
    for (kind, result), count in sorted(move_results.items()):
        out.setdefault(kind, {})[result] = count
    return out


# ---- admin HTTP API ---------------------------------------------------------------------------
class AdminApp:
    """``GET /v1/status``, ``GET /v1/instances/{id}``, ``POST /v1/rebalance``, ``POST /v1/drain``,
    ``GET /v1/drain/{id}``, ``POST /v1/uncordon``; JSON errors. With ``admin_token``, a request
    over TCP without ``Authorization: Bearer <admin_token>`` is answered 401 (the Unix socket is
    guarded by its mode and group)."""

    def __init__(self, gmanager: GManager, admin_token: str | None = None) -> None:
        self.gmanager = gmanager
        self.admin_token = admin_token

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self.check_token] if self.admin_token is not None else [])
        app.router.add_get("/v1/status", self.get_status)
        app.router.add_get("/v1/instances/{inst_id}", self.get_instance)
        app.router.add_post("/v1/rebalance", self.post_rebalance)
        app.router.add_post("/v1/drain", self.post_drain)
        app.router.add_get("/v1/drain/{inst_id}", self.get_drain)
        app.router.add_post("/v1/uncordon", self.post_uncordon)
        return app

    @web.middleware
    async def check_token(self, request: web.Request, handler) -> web.StreamResponse:
        sock = request.transport.get_extra_info("socket") if request.transport is not None else None
        over_tcp = sock is None or sock.family != socket.AF_UNIX  # unknown: treated as TCP
        if over_tcp and not bearer_matches(request.headers.get("Authorization"), self.admin_token):
            response = _error(401, "the admin API over TCP needs the bearer token of --admin-token-file "
                                   "(Authorization: Bearer <token>)")
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
        return await handler(request)

    async def post_drain(self, request: web.Request) -> web.Response:
        body = await _json_object(request, required={"instance_id"}, optional={"dry_run", "own_blocks"})
        if isinstance(body, web.Response):
            return body
        dry_run, own_blocks = body.get("dry_run", False), body.get("own_blocks", True)
        for name, value in (("dry_run", dry_run), ("own_blocks", own_blocks)):
            if not isinstance(value, bool):
                return _error(400, f"{name} must be true or false, got {value!r}")
        return await _drain_call(lambda: self.gmanager.drain(body["instance_id"], dry_run, own_blocks))

    async def get_drain(self, request: web.Request) -> web.Response:
        try:
            inst_id = int(request.match_info["inst_id"])
        except ValueError:
            return _error(400, f"instance id must be an integer, got {request.match_info['inst_id']!r}")

        async def status() -> dict[str, Any]:
            return self.gmanager.drain_status(inst_id)
        return await _drain_call(status)

    async def post_uncordon(self, request: web.Request) -> web.Response:
        body = await _json_object(request, required={"instance_id"}, optional=set())
        if isinstance(body, web.Response):
            return body
        return await _drain_call(lambda: self.gmanager.uncordon(body["instance_id"]))

    async def get_status(self, request: web.Request) -> web.Response:
        return web.json_response(self.gmanager.status())

    async def get_instance(self, request: web.Request) -> web.Response:
        try:
            inst_id = int(request.match_info["inst_id"])
        except ValueError:
            return _error(400, f"instance id must be an integer, got {request.match_info['inst_id']!r}")
        now_s = self.gmanager.clock()
        record = {r.inst_id: r for r in self.gmanager.view.live(now_s)}.get(inst_id)
        if record is None:
            return _error(404, f"unknown instance {inst_id} (no recent heartbeat)")
        return web.json_response(self.gmanager.instance_status(record, now_s))

    async def post_rebalance(self, request: web.Request) -> web.Response:
        body = await _json_object(request, required=set(), optional={"dry_run"})
        if isinstance(body, web.Response):
            return body
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            return _error(400, f"dry_run must be true or false, got {dry_run!r}")
        try:
            return web.json_response(await self.gmanager.rebalance(dry_run))
        except NotLeader as err:
            return _error(503, str(err))
        except InconsistentState as err:
            return _error(409, str(err))


def _is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) listens on the loopback only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(status: int, detail: str) -> web.Response:
    return web.json_response({"error": detail}, status=status)


async def _json_object(request: web.Request, required: set[str], optional: set[str]) -> dict[str, Any] | web.Response:
    """The body as a JSON object with only the given fields (``instance_id``, where present,
    an integer), or the 400 answer."""
    try:
        body = json.loads(await request.read() or b"{}")
    except ValueError as err:
        return _error(400, f"body is not JSON: {err}")
    except RecursionError:  # not a ValueError: arrays or objects nested thousands deep
        return _error(400, "body nests arrays or objects too deeply to parse")
    if not isinstance(body, dict):
        return _error(400, "body must be a JSON object")
    unknown = sorted(set(body) - required - optional)
    if unknown:
        return _error(400, f"unknown fields: {', '.join(unknown)}")
    missing = sorted(required - set(body))
    if missing:
        return _error(400, f"missing fields: {', '.join(missing)}")
    if "instance_id" in body and type(body["instance_id"]) is not int:
        return _error(400, f"instance_id must be an integer, got {body['instance_id']!r}")
    return body


async def _drain_call(call: Callable[[], Any]) -> web.Response:
    """Run a drain command; its refusals become JSON errors."""
    try:
        return web.json_response(await call())
    except NotLeader as err:
        return _error(503, str(err))
    except UnknownInstance as err:
        return _error(404, str(err))
    except DrainRefused as err:
        return _error(409, f"drain refused, nothing moved: {err}")
    except CommandFailed as err:
        return _error(502, str(err))


# ---- entry point ----------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> GManagerConfig:
    p = argparse.ArgumentParser(prog="python -m infinite_llm.scheduler.gmanager",
                                description="The gManager: one replica; the elected leader plans and moves KV.")
    p.add_argument("--state-dir", type=Path, required=True, help="shared with the instances")
    p.add_argument("--perf-model", type=Path, required=True, help="a fitted perf model (JSON)")
    p.add_argument("--peer-host", default="127.0.0.1")
    p.add_argument("--peer-port", type=int, default=0)
    p.add_argument("--http-host", default="127.0.0.1")
    p.add_argument("--http-port", type=int, default=0)
    p.add_argument("--socket-path", type=Path, default=None)
    p.add_argument("--socket-group", default=None,
                   help="the admin socket's group, e.g. infinite-llm-admin (mode 0660); default: the process's")
    p.add_argument("--admin-token-file", type=Path, default=None,
                   help="a file holding the bearer token that requests to the admin API over TCP must carry "
                        "(the instances' gmanager_token_file names the same); default: TCP takes any caller")
    p.add_argument("--heartbeat-interval-s", type=float, default=1.0)
    p.add_argument("--silent-after-heartbeats", type=int, default=5)
    p.add_argument("--plan-interval-s", type=float, default=2.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--debtor-max-batch", type=int, default=32)
    p.add_argument("--creditor-max-used-fraction", type=float, default=0.9)
    p.add_argument("--max-moves-per-round", type=int, default=16)
    p.add_argument("--move-timeout-s", type=float, default=60.0)
    p.add_argument("--election-poll-s", type=float, default=0.2)
    p.add_argument("--etcd-endpoints", default="", help="comma-separated host:port list: elect and find "
                   "instances through etcd instead of the state folder")
    p.add_argument("--etcd-prefix", default="/infinite-llm", help="the cluster's keys in etcd")
    p.add_argument("--etcd-lease-ttl-s", type=float, default=10.0, help="the leader's lease, s (at least 2)")
    p.add_argument("--etcd-request-s", type=float, default=2.0, help="one request to etcd, s")
    p.add_argument("--remote-overhead-window-s", type=float, default=60.0,
                   help="learn the policy's remote-attention overhead from the heartbeats of this window, s "
                        "(0: keep the calibrated one)")
    a = p.parse_args(argv)
    socket_gid = None
    if a.socket_group is not None:
        try:
            socket_gid = grp.getgrnam(a.socket_group).gr_gid
        except KeyError:
            p.error(f"--socket-group: no group {a.socket_group!r} on this host")
    admin_token = None
    if a.admin_token_file is not None:
        try:
            admin_token = read_admin_token(a.admin_token_file)
        except ValueError as err:
            p.error(f"--admin-token-file: {err}")
    return GManagerConfig(socket_gid=socket_gid, admin_token=admin_token,
        state_dir=a.state_dir, perf_model_path=a.perf_model, peer_host=a.peer_host, peer_port=a.peer_port,
        http_host=a.http_host, http_port=a.http_port, socket_path=a.socket_path,
        heartbeat_interval_s=a.heartbeat_interval_s, silent_after_heartbeats=a.silent_after_heartbeats,
        plan_interval_s=a.plan_interval_s, block_size=a.block_size, debtor_max_batch=a.debtor_max_batch,
        creditor_max_used_fraction=a.creditor_max_used_fraction, max_moves_per_round=a.max_moves_per_round,
        move_timeout_s=a.move_timeout_s, election_poll_s=a.election_poll_s,
        etcd_endpoints=tuple(e.strip() for e in a.etcd_endpoints.split(",") if e.strip()),
        etcd_prefix=a.etcd_prefix, etcd_lease_ttl_s=a.etcd_lease_ttl_s, etcd_request_s=a.etcd_request_s,
        remote_overhead_window_s=a.remote_overhead_window_s)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("INFLLM_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = parse_args(argv)
        model = load_model(config.perf_model_path)
    except (ValueError, OSError) as err:
        print(f"gmanager: {err}", file=sys.stderr)
        return 2
    election: Election
    if config.etcd_endpoints:
        election = EtcdElection(config.etcd_endpoints, prefix=config.etcd_prefix,
                                 lease_ttl_s=config.etcd_lease_ttl_s, request_timeout_s=config.etcd_request_s)
    else:
        election = LocalElection(config.state_dir, poll_interval_s=config.election_poll_s)
    try:
        return asyncio.run(GManager(config, model, election).run())
    except (EtcdUnreachable, AdminSocketInUse) as err:
        print(f"gmanager: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
