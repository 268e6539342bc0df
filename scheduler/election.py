"""Leader election for gManager replicas: who leads, and the epoch that fences its commands.

One interface, two backends:

* :class:`LocalElection` (single machine, built): leadership is an exclusive ``flock`` on
  ``<state_dir>/gmanager/leader.lock`` held for the leader's whole life. The kernel drops the
  lock when the process dies, ``kill -9`` included, so a standby polling the lock takes over
  without anyone cleaning up. The epoch is a counter in ``<state_dir>/gmanager.epoch``,
  incremented under the lock by each new leader, so it strictly increases across leaders; it
  lies outside ``gmanager/``, so that removing that folder (which deposes the leader) does not
  start the count again below the epoch the instances have seen (they would refuse every
  later leader).
* :class:`~.etcd_election.EtcdElection` (several hosts): a lease kept alive by each replica, a
  transaction that creates the leader key only if absent; the key's create revision is the
  epoch; a lease not refreshed within half its TTL is lost leadership.

Both answer the same questions: :meth:`Election.campaign` (block until leading, return the
epoch), :meth:`Election.is_leader` (still leading?), :meth:`Election.resign` and
:meth:`Election.leader` (who leads, for clients and standbys); :meth:`Election.close` releases
what the backend holds when the replica stops.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol


@dataclass(frozen=True)
class LeaderInfo:
    """What the leader publishes: its epoch and where instances and admins reach it."""

    epoch: int  # fencing token, strictly increasing across leaders
    pid: int  # the leader's process id
    peer_host: str  # its UCX listener: instances send Heartbeats here
    peer_port: int
    http_port: int  # its admin HTTP API on TCP
    socket_path: str  # its admin HTTP API on a Unix socket


@dataclass(frozen=True)
class CandidateAddresses:
    """A replica's addresses, known before it leads (its listeners start first)."""

    peer_host: str
    peer_port: int
    http_port: int
    socket_path: str


class Election(Protocol):
    async def campaign(self, addresses: CandidateAddresses) -> LeaderInfo:
        """Wait until this replica leads; publish and return its leadership (with the epoch)."""
        ...

    def is_leader(self) -> bool:
        """Whether this replica still leads (a lost lock or lease: it must stop commanding)."""
        ...

    def resign(self) -> None:
        """Give up leadership at once so that a standby takes over without waiting."""
        ...

    def leader(self) -> LeaderInfo | None:
        """The current leader as published, or None when none is known."""
        ...

    async def close(self) -> None:
        """Release connections and finish a resignation (bounded); called once, at stop."""
        ...


class LocalElection:
    """Election on a lock file in a state folder shared by the replicas of one machine."""

    def __init__(self, state_dir: str | Path, poll_interval_s: float = 0.2) -> None:
        if poll_interval_s <= 0:
            raise ValueError(f"poll_interval_s must be positive, got {poll_interval_s}")
        self.folder = Path(state_dir) / "gmanager"
        self.lock_path = self.folder / "leader.lock"
        self.epoch_path = Path(state_dir) / "gmanager.epoch"
        self._epoch_path_before = self.folder / "epoch"  # where earlier versions kept it
        self.leader_path = self.folder / "leader.json"
        self.poll_interval_s = poll_interval_s  # how often a standby retries the lock, s
        self._lock_fd: int | None = None
        self._info: LeaderInfo | None = None

    async def campaign(self, addresses: CandidateAddresses) -> LeaderInfo:
        while not self._try_lock():
            await asyncio.sleep(self.poll_interval_s)
        epoch = self._read_epoch() + 1
        # The epoch is durable before anything is commanded with it: a leader that crashes
        # right after must not let its successor reuse the number.
        _write_atomically(self.epoch_path, f"{epoch}\n")
        self._info = LeaderInfo(epoch=epoch, pid=os.getpid(), **asdict(addresses))
        _write_atomically(self.leader_path, json.dumps(asdict(self._info)))
        return self._info

    def is_leader(self) -> bool:
        """True while this process holds the lock on the file that is at ``lock_path`` now.

        ``flock`` cannot be taken away, but the lock file can be removed (or the state folder
        with it); a new file there would let another replica lock it, so the inode is checked.
        """
        if self._lock_fd is None:
            return False
        try:
            on_disk = os.stat(self.lock_path)
        except FileNotFoundError:
            return False
        held = os.fstat(self._lock_fd)
        return (on_disk.st_dev, on_disk.st_ino) == (held.st_dev, held.st_ino)

    def resign(self) -> None:
        if self._lock_fd is None:
            return
        if self.is_leader():
            # Only our own record is removed; a successor's must stay.
            current = self.leader()
            if current is not None and current.pid == os.getpid():
                self.leader_path.unlink(missing_ok=True)
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        os.close(self._lock_fd)
        self._lock_fd = None
        self._info = None

    async def close(self) -> None:
        """Nothing to release beyond the lock, which ``resign`` (or the process's exit) drops."""

    def leader(self) -> LeaderInfo | None:
        try:
            return LeaderInfo(**json.loads(self.leader_path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # no leader yet, or a record not ours

    def _try_lock(self) -> bool:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        if not self.is_leader():  # the file was replaced between open and lock: try again
            self.resign()
            return False
        return True

    def _read_epoch(self) -> int:
        return max(_read_counter(self.epoch_path), _read_counter(self._epoch_path_before))


def _read_counter(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return 0
    epoch = int(text)  # a corrupt counter must stop the election, not restart it at 1
    if epoch < 0:
        raise ValueError(f"{path} holds a negative epoch {epoch}")
    return epoch


def _write_atomically(path: Path, text: str) -> None:
    """Readers see the old or the new content, never a part: temporary file, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
