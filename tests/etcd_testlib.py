"""A real etcd server for tests: a private data folder, free loopback ports, killed at the end.

Debian's ``etcd-server`` package gives ``/usr/bin/etcd`` (``make setup`` installs it). Tests
that need it take the ``etcd`` fixture (import it into the test module); without the binary
they are skipped with the reason. Every wait here is bounded.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from infinite_llm.daemon.membership import Member
from infinite_llm.scheduler.election import CandidateAddresses

ETCD_BINARY = shutil.which("etcd") or "/usr/bin/etcd"
START_TIMEOUT_S = 20.0


def _ephemeral_port_range() -> tuple[int, int]:
    try:
        low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A loopback port free now, taken below the kernel's ephemeral range.

    A port the kernel hands out for port 0 can be handed out again, between our release and
    etcd's bind, as the local end of any outgoing connection (a client's, UCX's); ports below
    the ephemeral range are only ever taken by an explicit bind.
    """
    ephemeral_low, _ = _ephemeral_port_range()
    low, high = 10000, ephemeral_low - 1
    if high - low < 1000:
        low, high = 1024, ephemeral_low - 1
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {low}-{high}")


def closed_port() -> int:
    """A loopback port nothing listens on (taken and released: nobody binds it in between)."""
    return free_port()


class EtcdServer:
    """One single-member etcd on 127.0.0.1, its data in a temporary folder."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="infllm-etcd-"))
        self.data_dir = self.root / "etcd-data"
        self.log_path = self.root / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.process: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client API, as the daemons and infctl take it."""
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "EtcdServer":
        client_url, peer_url = f"http://127.0.0.1:{self.client_port}", f"http://127.0.0.1:{self.peer_port}"
        args = [ETCD_BINARY, "--name", "test", "--data-dir", str(self.data_dir),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", f"test={peer_url}", "--log-level", "warn"]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(f"{client_url}/health", timeout=1.0) as response:
                    if b'"true"' in response.read():
                        return self
            except OSError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"etcd did not become healthy within {timeout_s} s: {self.log()}")

    def log(self) -> str:
        try:
            return self.log_path.read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM, SIGKILL after 5 s; the data folder goes too."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def etcd():
    """A running etcd for the test module; stopped (and its data removed) at the end."""
    if not os.access(ETCD_BINARY, os.X_OK):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    for attempt in range(3):
        server = EtcdServer()
        try:
            server.start()
            break
        except RuntimeError as error:
            server.stop()
            # Another process bound a chosen port between our check and etcd's bind: new ports.
            if "address already in use" not in str(error) or attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


# ---- what the etcd tests share ---------------------------------------------------------------
def addresses(port: int) -> CandidateAddresses:
    """A gManager replica's addresses, told apart by ``port``."""
    return CandidateAddresses(peer_host="127.0.0.1", peer_port=port, http_port=port + 1, socket_path=f"/tmp/gm{port}.sock")


def member(inst_id: int, free: int = 10) -> Member:
    """An instance's membership record, with ``free`` blocks free of 64."""
    return Member(inst_id=inst_id, pid=1000 + inst_id, peer_host="10.0.0.1", peer_port=5000 + inst_id, http_port=0,
                  socket_path=f"/run/i{inst_id}.sock", num_blocks_total=64, num_blocks_free=free, draining=False,
                  updated_at=time.time())


def run(coroutine, timeout_s: float = 30.0):
    """Run ``coroutine`` on a fresh event loop, within ``timeout_s``."""
    async def bounded():
        async with asyncio.timeout(timeout_s):
            return await coroutine
    return asyncio.run(bounded())
