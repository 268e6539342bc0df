"""Real gManager processes and a heartbeat sender for the gManager tests, and an in-process
gManager fed by hand (:class:`Cluster`).

Instances do not send heartbeats yet, so the tests send them from a UCX transport of the test
process, on one event loop per test module (UCX binds its context to the loop that uses it).
Every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

# Loopback without a GPU, for this process's transport and the gManager processes alike.
os.environ.setdefault("UCX_TLS", "tcp,sm,self")
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

from infinite_llm.daemon.local_cluster import UnixHTTPConnection  # noqa: E402
from infinite_llm.daemon.membership import LocalMembership, Member  # noqa: E402
from infinite_llm.scheduler.election import LeaderInfo, LocalElection  # noqa: E402
from infinite_llm.scheduler.gmanager import GManager, GManagerConfig  # noqa: E402
from infinite_llm.scheduler.perf_model import load_model  # noqa: E402
from infinite_llm.transport.interface import PeerAddress, TransportConfig  # noqa: E402
from infinite_llm.transport.messages import (  # noqa: E402
    Ack,
    Drain,
    Heartbeat,
    MoveKV,
    PlacementKey,
    PoolFigures,
    RequestPlacementEntry,
    Uncordon,
)

PERF_MODEL = Path(__file__).resolve().parents[2] / "bench" / "results" / "perf_model-cpu.json"
START_TIMEOUT_S = 60.0


class GManagerProcess:
    """One ``python -m infinite_llm.scheduler.gmanager`` replica with its own socket and log.

    With ``default_socket_path`` no ``--socket-path`` is given: the replica takes its default,
    ``<state_dir>/gmanager/<pid>.sock``.
    """

    def __init__(self, state_dir: Path, name: str, extra_args: list[str] | None = None,
                 default_socket_path: bool = False) -> None:
        self.state_dir = state_dir
        self.socket_path = state_dir.parent / f"{name}.sock"
        self.log_path = state_dir.parent / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        socket_args = [] if default_socket_path else ["--socket-path", str(self.socket_path)]
        args = [sys.executable, "-m", "infinite_llm.scheduler.gmanager", "--state-dir", str(state_dir),
                "--perf-model", str(PERF_MODEL), "--http-port", "0", *socket_args,
                "--election-poll-s", "0.1", *(extra_args or [])]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        if default_socket_path:
            self.socket_path = state_dir / "gmanager" / f"{self.process.pid}.sock"

    def log(self) -> str:
        return self.log_path.read_text()[-4000:]

    def request(self, method: str, path: str, body: Any = None, timeout_s: float = 30.0) -> tuple[int, Any]:
        conn = UnixHTTPConnection(str(self.socket_path), timeout=timeout_s)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            return response.status, json.loads(response.read())
        finally:
            conn.close()

    def status(self) -> dict[str, Any]:
        code, body = self.request("GET", "/v1/status")
        assert code == 200, body
        return body

    def wait_serving(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        """Until the admin API answers; returns the first status."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"gManager exited with {self.process.returncode}: {self.log()}")
            try:
                return self.status()
            except (OSError, ConnectionError):
                time.sleep(0.1)
        raise TimeoutError(f"gManager did not serve within {timeout_s} s: {self.log()}")

    def wait_leading(self, timeout_s: float = START_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        self.wait_serving(timeout_s)
        while time.monotonic() < deadline:
            status = self.status()
            if status["leader"]:
                return status
            time.sleep(0.05)
        raise TimeoutError(f"gManager did not lead within {timeout_s} s: {self.log()}")

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, then SIGKILL if it does not exit in time; returns the exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.process.returncode


def leader_record(state_dir: Path) -> dict[str, Any]:
    return json.loads((state_dir / "gmanager" / "leader.json").read_text())


def leader_address(state_dir: Path) -> PeerAddress:
    record = leader_record(state_dir)
    return PeerAddress(record["peer_host"], record["peer_port"])


class HeartbeatSender:
    """A UCX transport on its own event loop, standing in for instances' heartbeats."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.transport = None

    def run(self, coroutine: Coroutine, timeout_s: float = 30.0):
        async def bounded():
            async with asyncio.timeout(timeout_s):
                return await coroutine
        return self.loop.run_until_complete(bounded())

    def start(self) -> None:
        from infinite_llm.transport.ucx import UcxTransport

        async def serves_nothing(message):
            raise ValueError("the test's transport serves nothing")

        self.transport = UcxTransport(TransportConfig(request_timeout_s=10.0))
        self.run(self.transport.start(serves_nothing))

    def send(self, peer: PeerAddress, heartbeat: Heartbeat):
        """The reply, or the transport's exception (a refusal is a RemoteError)."""
        async def one():
            try:
                return await self.transport.request(peer, heartbeat, timeout_s=10.0)
            except Exception as err:  # returned, so that tests can assert on it
                return err
        return self.run(one())

    def close(self) -> None:
        if self.transport is not None:
            self.run(self.transport.close())
        self.loop.close()


def heartbeat(inst_id: int, seq: int, total: int, free: int, batch: int, base: int, version: int,
              upserts: tuple[tuple[int, int, int], ...] = (), removals: tuple[tuple[int, int], ...] = (),
              lent: int = 0, borrowed: int = 0) -> Heartbeat:
    """A heartbeat of ``inst_id``; upserts are (req_id, inst_id, num_blocks), removals (req_id, inst_id)."""
    return Heartbeat(
        inst_id=inst_id, seq=seq, pool=PoolFigures(total, free, lent, borrowed), batch_size=batch,
        placement_base_version=base, placement_version=version,
        placement_upserts=tuple(RequestPlacementEntry(r, i, n, i == inst_id) for r, i, n in upserts),
        placement_removals=tuple(PlacementKey(r, i) for r, i in removals))


# ---- an in-process gManager ---------------------------------------------------------------------
PORT_BASE = 41000  # instance i listens on PORT_BASE + i


class RecordingTransport:
    """Answers every command with Ack and records (receiver, message)."""

    address = PeerAddress("127.0.0.1", 1)

    def __init__(self) -> None:
        self.sent: list[tuple[int, object]] = []

    async def request(self, peer, message, timeout_s=None):
        self.sent.append((peer.port - PORT_BASE, message))
        return Ack()

    def commands(self) -> list[tuple]:
        """The trace, with the fields that matter (move ids and epochs aside)."""
        out = []
        for inst_id, m in self.sent:
            if isinstance(m, MoveKV):
                out.append((inst_id, "move", m.home_inst_id, m.req_id, m.src_inst_id, m.dst_inst_id, m.num_blocks))
            elif isinstance(m, (Drain, Uncordon)):
                out.append((inst_id, m.TYPE, m.inst_id))
        return out


class HeldElection(LocalElection):
    """Leadership taken by the test, and lost when it sets ``leading`` false: the lock file is
    never involved."""

    leading = True

    def is_leader(self) -> bool:
        return self.leading


class Cluster:
    """A gManager leading with epoch 4 over three instances described by hand-fed heartbeats;
    ``config`` sets more GManagerConfig fields."""

    def __init__(self, tmp_path: Path, **config: Any) -> None:
        self.now = 0.0
        self.seq = {1: 0, 2: 0, 3: 0}
        self.election = HeldElection(tmp_path)
        config = GManagerConfig(state_dir=tmp_path, perf_model_path=PERF_MODEL, heartbeat_interval_s=0.02,
                                silent_after_heartbeats=1000, **config)
        self.gm = GManager(config, load_model(PERF_MODEL), self.election, clock=lambda: self.now)
        self.gm.leadership = LeaderInfo(epoch=4, pid=os.getpid(), peer_host="127.0.0.1", peer_port=1,
                                        http_port=0, socket_path="")
        self.gm.transport = self.transport = RecordingTransport()
        self.members = LocalMembership(tmp_path, stale_after_s=3600)
        for inst_id in (1, 2, 3):
            self.publish(inst_id)

    def publish(self, inst_id: int, draining: bool = False) -> None:
        """The instance's membership record, as ``infinited`` writes it (draining: it is cordoned)."""
        self.members.publish(Member(inst_id, os.getpid(), "127.0.0.1", PORT_BASE + inst_id, 0, "", 64, 0, draining,
                                    time.time()))

    def beat(self, inst_id: int, free: int, batch: int, upserts=(), lent: int = 0, borrowed: int = 0) -> None:
        """A full-state heartbeat of ``inst_id`` at the current time."""
        self.seq[inst_id] += 1
        self.gm.view.receive(heartbeat(inst_id, self.seq[inst_id], 64, free, batch, 0, self.seq[inst_id],
                                       upserts=upserts, lent=lent, borrowed=borrowed), now_s=self.now)

    def one_debtor_two_empty(self) -> None:
        """Instance 1 is a debtor with one long request (7, its 64 blocks all at home) and a full
        pool; 2 and 3 are empty."""
        self.beat(1, 0, 1, upserts=((7, 1, 64),))
        self.beat(2, 64, 0)
        self.beat(3, 64, 0)

    def restart(self, inst_id: int) -> None:
        """The instance starts again: its heartbeats number from 1."""
        self.seq[inst_id] = 0


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)
