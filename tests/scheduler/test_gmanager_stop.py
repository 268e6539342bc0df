"""A real gManager process stops within systemd's TimeoutStopSec=30 while admin API clients hold
it up: an idle keep-alive connection, an upload that never ends, a rebalance waiting for a
MoveKV that is never answered. aiohttp's default would wait 60 s for each request in progress."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from infinite_llm.scheduler.gmanager import HTTP_SHUTDOWN_S
from gmanager_testlib import GManagerProcess

SYSTEMD_STOP_S = 30.0  # TimeoutStopSec of systemd/*.service
# What a stop may take: the admin API's bound (twice HTTP_SHUTDOWN_S, see gmanager.py) and the
# rest of the stop (about a second here).
STOP_BOUND_S = 2 * HTTP_SHUTDOWN_S + 5.0

# An instance that publishes its address, sends two heartbeats (instance 31 a debtor with a full
# pool, 32 empty: the policy moves blocks from 31 to 32) and then never answers a command. It
# writes <flags>/ready after the heartbeats, <flags>/move when a MoveKV arrives.
HANGING_INSTANCE = r"""
import asyncio, os, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from gmanager_testlib import heartbeat, leader_address
from infinite_llm.daemon.membership import LocalMembership, Member
from infinite_llm.transport.interface import TransportConfig
from infinite_llm.transport.messages import MoveKV
from infinite_llm.transport.ucx import UcxTransport

state, flags = Path(sys.argv[1]), Path(sys.argv[2])

async def main():
    async def hang(message):
        if isinstance(message, MoveKV):
            (flags / "move").touch()
        await asyncio.sleep(3600)

    transport = UcxTransport(TransportConfig(request_timeout_s=10.0))
    await transport.start(hang)
    members = LocalMembership(state, stale_after_s=3600)
    for inst_id in (31, 32):
        members.publish(Member(inst_id, os.getpid(), transport.address.host, transport.address.port, 0, "", 64, 64,
                               False, time.time()))
    peer = leader_address(state)
    await transport.request(peer, heartbeat(31, 1, 64, 4, 1, 0, 1, upserts=((77, 31, 60),)), timeout_s=10.0)
    await transport.request(peer, heartbeat(32, 1, 64, 64, 0, 0, 1), timeout_s=10.0)
    (flags / "ready").touch()
    await asyncio.sleep(600)

asyncio.run(main())
"""


def wait_for(path: Path, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert process.poll() is None, f"the process exited with {process.returncode}"
        assert time.monotonic() < deadline, f"{path.name} not reached within {timeout_s} s"
        time.sleep(0.05)


def time_to_exit(gm: GManagerProcess) -> tuple[int | None, float]:
    """SIGTERM; the exit code (None: still running at systemd's limit, then killed) and the time."""
    started = time.monotonic()
    gm.process.send_signal(signal.SIGTERM)
    try:
        code = gm.process.wait(timeout=SYSTEMD_STOP_S)
    except subprocess.TimeoutExpired:
        code = None
        gm.kill()
    return code, time.monotonic() - started


def test_a_stop_is_not_held_by_an_idle_connection_or_an_unfinished_upload(tmp_path) -> None:
    gm = GManagerProcess(tmp_path / "state", "gm", ["--plan-interval-s", "3600"])
    idle = upload = None
    try:
        port = gm.wait_leading()["http_port"]
        idle = socket.create_connection(("127.0.0.1", port), timeout=10.0)
        idle.sendall(b"GET /v1/status HTTP/1.1\r\nHost: gm\r\n\r\n")  # keep-alive: stays open after it
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        # A drain request whose body never comes in full: its handler waits for the rest.
        upload = socket.create_connection(("127.0.0.1", port), timeout=10.0)
        upload.sendall(b"POST /v1/drain HTTP/1.1\r\nHost: gm\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 100\r\n\r\n{\"instance_")
        gm.status()  # served after the upload's headers were read: its handler is waiting
        time.sleep(0.2)
        code, elapsed = time_to_exit(gm)
        assert code == 0, gm.log()
        assert elapsed < STOP_BOUND_S, f"stopped after {elapsed:.1f} s"
        assert "gManager stopped" in gm.log()
    finally:
        for conn in (idle, upload):
            if conn is not None:
                conn.close()
        gm.kill()


def test_a_stop_is_not_held_by_a_rebalance_waiting_for_a_move(tmp_path) -> None:
    """The rebalance waits for a MoveKV's answer (up to --move-timeout-s, 60 s): the stop cuts it short."""
    state, flags = tmp_path / "state", tmp_path / "flags"
    flags.mkdir()
    gm = GManagerProcess(state, "gm", ["--plan-interval-s", "3600", "--heartbeat-interval-s", "30"])
    instance = None
    answers: list = []
    try:
        gm.wait_leading()
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        with open(tmp_path / "instance.log", "w") as log:
            instance = subprocess.Popen([sys.executable, "-c", HANGING_INSTANCE, str(state), str(flags),
                                         str(Path(__file__).parent)], stdout=log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)
        wait_for(flags / "ready", instance)

        def rebalance() -> None:
            try:
                answers.append(gm.request("POST", "/v1/rebalance", {"dry_run": False}, timeout_s=90.0))
            except Exception as err:  # the stop closes the connection: no answer
                answers.append(err)

        client = threading.Thread(target=rebalance, daemon=True)
        client.start()
        wait_for(flags / "move", instance)
        code, elapsed = time_to_exit(gm)
        assert code == 0, gm.log()
        assert elapsed < STOP_BOUND_S, f"stopped after {elapsed:.1f} s"
        client.join(timeout=10.0)
        assert len(answers) == 1 and isinstance(answers[0], Exception), answers
    finally:
        gm.kill()
        if instance is not None:
            if instance.poll() is None:
                os.killpg(instance.pid, signal.SIGKILL)
            instance.wait(timeout=10)
