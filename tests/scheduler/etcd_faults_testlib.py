"""Faults between the daemons and etcd, for tests: a cluster of real etcd members that can be
killed and restarted one by one, and a TCP proxy whose connections can be cut or stalled.

Every wait here is bounded. The members run on loopback ports, their data in a temporary
folder removed by ``stop``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from etcd_testlib import ETCD_BINARY, START_TIMEOUT_S, free_port


class EtcdCluster:
    """``num_members`` etcd members forming one cluster on 127.0.0.1."""

    def __init__(self, num_members: int) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="infllm-etcd-cluster-"))
        self.names = [f"m{i}" for i in range(num_members)]
        self.client_ports = [free_port() for _ in self.names]
        self.peer_ports = [free_port() for _ in self.names]
        self.processes: list[subprocess.Popen | None] = [None] * num_members

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of each member's client API, in member order."""
        return [f"127.0.0.1:{port}" for port in self.client_ports]

    def start(self, timeout_s: float = START_TIMEOUT_S) -> "EtcdCluster":
        for index in range(len(self.names)):
            self._spawn(index)
        self.wait_healthy(range(len(self.names)), timeout_s)
        return self

    def kill(self, index: int) -> None:
        """SIGKILL one member (its data stays, so ``restart`` brings it back as it was)."""
        process = self.processes[index]
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        self.processes[index] = None

    def restart(self, index: int, timeout_s: float = START_TIMEOUT_S) -> None:
        self._spawn(index)
        self.wait_healthy([index], timeout_s)

    def leader_index(self) -> int:
        """Index of the member that is etcd's raft leader now."""
        member_ids = []
        leader_id = None
        for port in self.client_ports:
            status = self._post(port, "/v3/maintenance/status")
            member_ids.append(status["header"]["member_id"])
            leader_id = status["leader"]
        return member_ids.index(leader_id)

    def wait_healthy(self, indexes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for index in indexes:
            while not self._healthy(index):
                process = self.processes[index]
                if process is not None and process.poll() is not None:
                    raise RuntimeError(f"etcd {self.names[index]} exited with {process.returncode}: {self.log(index)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"etcd {self.names[index]} not healthy within {timeout_s} s: {self.log(index)}")
                time.sleep(0.1)

    def log(self, index: int) -> str:
        try:
            return (self.root / f"{self.names[index]}.log").read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        for index in range(len(self.names)):
            self.kill(index)
        shutil.rmtree(self.root, ignore_errors=True)

    def _spawn(self, index: int) -> None:
        cluster = ",".join(f"{name}=http://127.0.0.1:{port}" for name, port in zip(self.names, self.peer_ports))
        client_url = f"http://127.0.0.1:{self.client_ports[index]}"
        peer_url = f"http://127.0.0.1:{self.peer_ports[index]}"
        args = [ETCD_BINARY, "--name", self.names[index], "--data-dir", str(self.root / self.names[index]),
                "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
                "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
                "--initial-cluster", cluster, "--initial-cluster-state", "new", "--log-level", "warn"]
        with open(self.root / f"{self.names[index]}.log", "a") as log:
            self.processes[index] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT,
                                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def _healthy(self, index: int) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.client_ports[index]}/health", timeout=1.0) as response:
                return b'"true"' in response.read()
        except OSError:
            return False

    @staticmethod
    def _post(port: int, path: str) -> dict:
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=2.0) as response:
            return json.loads(response.read())


def etcd_cluster_of(num_members: int):
    """A fresh cluster for one test (skipped without the etcd binary); stopped at the end."""
    if not os.access(ETCD_BINARY, os.X_OK):
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    for attempt in range(3):
        cluster = EtcdCluster(num_members)
        try:
            return cluster.start()
        except RuntimeError as error:
            cluster.stop()
            # Another process bound a chosen port between our check and etcd's bind: new ports.
            if "address already in use" not in str(error) or attempt == 2:
                raise
        except BaseException:
            cluster.stop()
            raise


class TcpProxy:
    """``127.0.0.1:<port>`` forwarding to ``127.0.0.1:<target_port>`` on the running event loop.

    ``cut`` closes every connection and refuses new ones until ``heal`` (a network blip);
    ``stall`` holds bytes back, losing none, until ``resume`` (a slow link or a stalled etcd).
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self._open = True
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._connections: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._handlers: set[asyncio.Task] = set()
        self._server: asyncio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> "TcpProxy":
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    def cut(self) -> None:
        self._open = False
        for client_writer, target_writer in list(self._connections):
            client_writer.transport.abort()
            target_writer.transport.abort()
        self._connections.clear()

    def heal(self) -> None:
        self._open = True

    def stall(self) -> None:
        self._flowing.clear()

    def resume(self) -> None:
        self._flowing.set()

    async def close(self) -> None:
        """Stop listening and end every connection (bounded)."""
        self.cut()
        self._flowing.set()
        if self._server is not None:
            self._server.close()
        # Handlers left running would be cancelled noisily when the event loop closes.
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=2.0)

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        self._handlers.add(handler)
        handler.add_done_callback(self._handlers.discard)
        if not self._open:
            client_writer.transport.abort()
            return
        try:
            target_reader, target_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            client_writer.transport.abort()
            return
        pair = (client_writer, target_writer)
        self._connections.add(pair)
        try:
            await asyncio.gather(self._pump(client_reader, target_writer), self._pump(target_reader, client_writer))
        finally:
            self._connections.discard(pair)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                await self._flowing.wait()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass  # the other side went: so does this one
        finally:
            writer.transport.abort()
