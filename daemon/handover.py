"""Handing over, at a stop, the KV segments an instance holds for other instances' requests.

Segments held for another home die with the process, and with them that home's requests. So a
stopping instance that holds any asks the gManager leader to drain it (``POST /v1/drain`` with
its own id, on the leader's admin API): the leader cordons it and has each home move its
segments to other instances, creditor to creditor, while the homes go on decoding
(``docs/gmanager.md``, Drain). The instance then waits, bounded by ``timeouts.drain_s``, until
its ledger is empty; :class:`HandOver` asks, and asks again while that makes sense.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import aiohttp

from .admin_token import bearer_header
from .ledger import CreditorLedger
from .membership import process_alive

if TYPE_CHECKING:
    from .config import InstanceConfig
    from .etcd_discovery import EtcdMembership
    from .membership import LocalMembership

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaderAdmin:
    """Where the gManager leader's admin API listens, from its leader record."""

    epoch: int  # the leader's fencing token: a new leader knows of no drain yet
    host: str  # the leader's peer host, where its TCP admin API is sought (the record names no HTTP host)
    http_port: int  # its admin API on TCP; 0: none known
    socket_path: str  # its admin API on a Unix socket; "": none known (reachable on its host only)


@dataclass(frozen=True)
class DrainAnswer:
    """What became of one request for a drain."""

    outcome: str  # "accepted" (the leader drains the instance), "refused" (409: the others lack room), "failed"
    detail: str  # the leader's report or error, or why no answer came
    num_moves_planned: int = 0  # moves the leader planned when it accepted


def find_leader_admin(config: InstanceConfig, membership: LocalMembership | EtcdMembership) -> LeaderAdmin | None:
    """The leader's admin addresses: from the watched etcd leader key (no I/O here) or from the
    local election's record; None when no leader is known."""
    if config.discovery == "etcd":
        info = membership.leader()
        return None if info is None else LeaderAdmin(info.epoch, info.peer_host, info.http_port, info.socket_path)
    return leader_admin_local(config.state_dir)


def leader_admin_local(state_dir: Path) -> LeaderAdmin | None:
    """The leader of the local election (``<state_dir>/gmanager/leader.json``), if its process lives."""
    try:
        record = json.loads((Path(state_dir) / "gmanager" / "leader.json").read_text())
        leader = LeaderAdmin(int(record["epoch"]), str(record["peer_host"]), int(record["http_port"]),
                             str(record["socket_path"]))
        pid = int(record["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return leader if process_alive(pid) else None


async def request_drain(leader: LeaderAdmin, inst_id: int, timeout_s: float,
                        token: str | None = None) -> DrainAnswer:
    """``POST /v1/drain {"instance_id": inst_id, "own_blocks": false}`` to the leader: on its Unix socket when that is
    on this host, else on TCP, with ``token`` as its bearer token (the socket needs none). Each attempt is
    bounded by ``timeout_s`` (seconds); never raises."""
    # Only what it holds for others: its own requests finish here and free their blocks.
    body = {"instance_id": inst_id, "own_blocks": False}
    errors = []
    if leader.socket_path and os.path.exists(leader.socket_path):
        try:
            answer = await _post(aiohttp.UnixConnector(path=leader.socket_path), "http://gmanager/v1/drain",
                                 body, timeout_s)
            if answer.outcome != "failed":
                return answer
            # With the leader on another host, the same path may be a local standby's (503).
            errors.append(f"socket {leader.socket_path}: {answer.detail}")
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            # A stale file, or the socket of another host's leader: TCP may still reach it.
            errors.append(f"socket {leader.socket_path}: {str(exc) or type(exc).__name__}")
    if leader.http_port:
        url = f"http://{leader.host}:{leader.http_port}/v1/drain"
        try:
            return await _post(aiohttp.TCPConnector(), url, body, timeout_s,
                               bearer_header(token) if token is not None else None)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            errors.append(f"{url}: {str(exc) or type(exc).__name__}")
    return DrainAnswer("failed", "; ".join(errors) or "the leader record names no admin API")


async def _post(connector: aiohttp.BaseConnector, url: str, body: dict, timeout_s: float,
                headers: dict[str, str] | None = None) -> DrainAnswer:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        async with session.post(url, json=body, headers=headers) as response:
            try:
                report = await response.json(content_type=None)
            except ValueError:
                report = {"error": (await response.text())[:200]}
            if not isinstance(report, dict):
                report = {"error": str(report)[:200]}
            if response.status == 200:
                return DrainAnswer("accepted", report.get("state", "draining"), len(report.get("planned_moves", ())))
            detail = f"{response.status}: {report.get('error', report)}"
            return DrainAnswer("refused" if response.status == 409 else "failed", detail)


def blocks_held_by_home(ledger: CreditorLedger) -> dict[int, tuple[int, int]]:
    """Per home instance id: (segments held, blocks held or reserved) for its requests."""
    by_home: dict[int, tuple[int, int]] = {}
    for segment in ledger.held.values():
        num_segments, num_blocks = by_home.get(segment.home_inst_id, (0, 0))
        by_home[segment.home_inst_id] = (num_segments + 1, num_blocks + len(segment.block_ids))
    for reservation in ledger.reservations.values():
        num_segments, num_blocks = by_home.get(reservation.home_inst_id, (0, 0))
        by_home[reservation.home_inst_id] = (num_segments, num_blocks + len(reservation.block_ids))
    return by_home


def describe_held(by_home: dict[int, tuple[int, int]]) -> str:
    """``"12 blocks in 2 segments for instance 1, 3 blocks in 1 segment for instance 3"``."""
    return ", ".join(f"{b} blocks in {s} segment{'' if s == 1 else 's'} for instance {home}"
                     for home, (s, b) in sorted(by_home.items()))


class HandOver:
    """A stopping instance's requests for a drain of itself.

    It asks at once and again every ``retry_s`` until a leader accepts: a leader may appear (a
    standby taking over), learn of the instance from its next heartbeat (404) or find room as
    requests finish (409). It asks again when the leader changes, since drains are the leader's
    soft state. Asking again for a drain under way only reports it, so repeats are harmless.
    """

    def __init__(self, inst_id: int, find_leader: Callable[[], LeaderAdmin | None],
                 request_timeout_s: float, retry_s: float, token: str | None = None) -> None:
        """Args:
            find_leader: the leader's admin addresses now, or None when no leader is known.
            request_timeout_s: bound on one request to the leader, s.
            retry_s: pause between requests that were not accepted, s.
            token: the bearer token of the leader's admin API over TCP, or None.
        """
        self.inst_id = inst_id
        self.token = token
        self.find_leader = find_leader
        self.request_timeout_s = request_timeout_s
        self.retry_s = retry_s
        self.accepted_epoch: int | None = None  # the leader that accepted the drain
        self.last_answer: DrainAnswer | None = None
        self._next_ask_s = float("-inf")
        self._last_logged = ""

    def summary(self) -> str:
        """The last request's outcome, for the log."""
        answer = self.last_answer
        if answer is None:
            return "not asked"
        if answer.outcome == "accepted":
            return f"the leader of epoch {self.accepted_epoch} drains this instance ({answer.detail})"
        return f"{answer.outcome}: {answer.detail}"

    async def ask_if_due(self, now_s: float, deadline_s: float, held: str) -> None:
        """Ask the leader to drain this instance unless one already does or it is too early to
        ask again; ``now_s`` and ``deadline_s`` on the monotonic clock, ``held`` for the log."""
        if now_s < self._next_ask_s:
            return
        self._next_ask_s = now_s + self.retry_s
        leader = self.find_leader()
        if leader is not None and leader.epoch == self.accepted_epoch:
            return
        if leader is None:
            self.last_answer = DrainAnswer("failed", "no gManager leader is known")
        else:
            timeout_s = max(0.1, min(self.request_timeout_s, deadline_s - now_s))
            self.last_answer = await request_drain(leader, self.inst_id, timeout_s, self.token)
        answer = self.last_answer
        if answer.outcome == "accepted":
            self.accepted_epoch = leader.epoch
            log.info("hand-over: the gManager leader (epoch %d) drains instance %d to move %s elsewhere "
                     "(%d moves planned)", leader.epoch, self.inst_id, held, answer.num_moves_planned)
            self._last_logged = ""
            return
        # Logged once per kind of failure: the retries every few seconds would flood the log.
        what = f"{answer.outcome}: {answer.detail}"
        if what != self._last_logged:
            self._last_logged = what
            if answer.outcome == "refused":
                log.warning("hand-over: the gManager leader refused to drain instance %d (%s); holding %s until "
                            "their homes free them or the stop deadline, asking again every %.0f s",
                            self.inst_id, answer.detail, held, self.retry_s)
            else:
                log.warning("hand-over of %s not possible now (%s); waiting for their homes to free them until "
                            "the stop deadline, asking again every %.0f s", held, answer.detail, self.retry_s)
