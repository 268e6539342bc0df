"""Local membership: each instance publishes its addresses and pool figures in a state folder.

The single-machine default has no etcd: ``<state_dir>/members/<inst_id>.json`` is written
atomically (temporary file, then rename) every heartbeat period and removed on a clean stop.
Readers drop entries whose process is gone or that were not refreshed for a while, so a killed
instance leaves the membership without anyone cleaning up after it.

With several hosts the same records live in etcd under leases (:mod:`.etcd_discovery`);
:func:`membership_for` picks the backend from the configuration.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import InstanceConfig
    from .etcd_discovery import EtcdMembership


@dataclass(frozen=True)
class Member:
    inst_id: int
    pid: int
    peer_host: str  # UCX listener
    peer_port: int
    http_port: int  # OpenAI API; 0 when off
    socket_path: str  # local admin API
    num_blocks_total: int
    num_blocks_free: int  # free for new requests or for others' segments, blocks
    draining: bool
    updated_at: float  # time.time() seconds
    # Random, new at each start of the process (a pid may come again: a container's daemon
    # often has the same one at every start); 0 in a record that does not say.
    run_id: int = 0


class LocalMembership:
    def __init__(self, state_dir: Path, stale_after_s: float) -> None:
        self.folder = Path(state_dir) / "members"
        self.stale_after_s = stale_after_s

    async def start(self) -> None:
        """Nothing to connect to: the folder is made on the first publish."""

    async def close(self) -> None:
        """Nothing held open; ``withdraw`` removes the record."""

    def registered(self) -> bool:
        """A record in a local folder stands as long as this process runs."""
        return True

    def publish(self, member: Member) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{member.inst_id}.json"
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(member)))
        os.replace(tmp, path)

    async def wait_published(self, inst_id: int, timeout_s: float) -> bool:
        """Whether ``inst_id``'s record is written: ``publish`` writes it before it returns."""
        return (self.folder / f"{inst_id}.json").exists()

    def withdraw(self, inst_id: int) -> None:
        (self.folder / f"{inst_id}.json").unlink(missing_ok=True)

    def members(self) -> dict[int, Member]:
        """Live members by instance id."""
        found: dict[int, Member] = {}
        if not self.folder.is_dir():
            return found
        now = time.time()
        for path in self.folder.glob("*.json"):
            try:
                member = Member(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # half-written by a crashed writer or not ours: skip it
            if now - member.updated_at > self.stale_after_s or not process_alive(member.pid):
                continue
            found[member.inst_id] = member
        return found


def membership_for(config: "InstanceConfig") -> "LocalMembership | EtcdMembership":
    """etcd when the configuration names endpoints, else the state folder."""
    if config.discovery == "etcd":
        from .etcd_discovery import EtcdMembership

        return EtcdMembership(config.etcd_endpoints, prefix=config.etcd_prefix,
                              lease_ttl_s=config.timeouts.etcd_lease_s, request_timeout_s=config.timeouts.etcd_request_s)
    return LocalMembership(config.state_dir, stale_after_s=5 * config.timeouts.heartbeat_interval_s)


def process_alive(pid: int) -> bool:
    """Whether a process with this pid exists (one of another user's counts too)."""
    if pid <= 0:  # 0 and negatives name process groups, not a process
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
