"""A local cluster of `infinited` processes on this machine: start, find, talk to, stop.

Used by the tests, the benchmarks and the demo. Each instance listens for peers on loopback
UCX, publishes itself in ``<root>/state/members`` and serves its admin API on a Unix socket.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import http.client
import socket

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP over a Unix socket (the daemon's local admin API)."""

    def __init__(self, path: str, timeout: float = 60.0) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self.socket_path)


@dataclass
class Instance:
    inst_id: int
    process: subprocess.Popen
    socket_path: Path
    log_path: Path
    http_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def local(self, method: str, path: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
        conn = UnixHTTPConnection(str(self.socket_path), timeout=timeout)
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        raw = response.read()
        conn.close()
        if response.getheader("Content-Type", "").startswith("application/x-ndjson"):
            return response.status, [json.loads(line) for line in raw.splitlines() if line]
        return response.status, json.loads(raw)

    def status(self) -> dict[str, Any]:
        code, body = self.local("GET", "/v1/status")
        assert code == 200, body
        return body

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {sample name with its labels: value}, e.g.
        ``'infllm_kv_moves_total{result="committed"}'``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        samples = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in samples}

    def generate(self, prompt: str | list[int], **params: Any) -> tuple[list[int], str]:
        """Greedy unless params say otherwise; returns (token ids, text)."""
        code, lines = self.local("POST", "/v1/generate", {"prompt": prompt, "params": {"temperature": 0, **params}},
                                 timeout=300)
        assert code == 200, lines
        tokens = [t for line in lines for t in line["token_ids"]]
        return tokens, "".join(line["text"] for line in lines)

    def stream(self, prompt: str | list[int], timeout: float = 600.0, **params: Any) -> Iterator[dict[str, Any]]:
        """Stream ``/v1/generate``: one dict per step as it arrives (greedy unless params say otherwise)."""
        conn = UnixHTTPConnection(str(self.socket_path), timeout=timeout)
        body = json.dumps({"prompt": prompt, "params": {"temperature": 0, **params}}).encode()
        conn.request("POST", "/v1/generate", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"generate failed ({response.status}): {response.read()[:500]!r}")
        try:
            for line in response:
                if line.strip():
                    yield json.loads(line)
        finally:
            conn.close()

    def post(self, path: str, body: Any, timeout: float = 300.0) -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())


class LocalCluster:
    def __init__(self, root: Path, num_instances: int, pool_blocks: int, extra_args: list[str] | None = None,
                 extra_env: dict[str, str] | None = None, max_num_batched_tokens: int = 128,
                 device: str = "cpu", pool_blocks_per_instance: list[int] | None = None,
                 devices: list[str] | None = None, gmanager_perf_model: Path | None = None,
                 gmanager_args: list[str] | None = None, instance_args: list[list[str]] | None = None,
                 instance_env: list[dict[str, str]] | None = None) -> None:
        """``root`` holds the logs and the state folder; the sockets go to a folder of their own
        that every user may traverse, as /run/infinite-llm is, so that tests can call as others.
        ``devices``: one device per instance (say ``cuda:0``, ``cuda:1``), else ``device`` for all.
        ``gmanager_perf_model``: also run a gManager with this perf model (and ``gmanager_args``),
        elected through the same state folder. ``instance_args``: flags of each instance's own,
        after ``extra_args``; ``instance_env``: its environment's own, over ``extra_env``."""
        self.root = root
        self.socket_dir = Path(tempfile.mkdtemp(prefix="infllm-"))
        self.socket_dir.chmod(0o755)
        self.state_dir = root / "state"
        self.instances: dict[int, Instance] = {}
        self._launch: dict[int, tuple[list[str], dict[str, str]]] = {}  # instance id -> its command and env
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["UCX_TLS"] = "tcp,sm,self"  # no GPU: TCP and shared memory on loopback
        env.pop("TRITON_INTERPRET", None)
        env.update(extra_env or {})
        pools = pool_blocks_per_instance or [pool_blocks] * num_instances
        if len(pools) != num_instances:
            raise ValueError(f"{len(pools)} pool sizes for {num_instances} instances")
        devices = devices or [device] * num_instances
        if len(devices) != num_instances:
            raise ValueError(f"{len(devices)} devices for {num_instances} instances")
        instance_args = instance_args or [[] for _ in range(num_instances)]
        if len(instance_args) != num_instances:
            raise ValueError(f"{len(instance_args)} argument lists for {num_instances} instances")
        instance_env = instance_env or [{} for _ in range(num_instances)]
        if len(instance_env) != num_instances:
            raise ValueError(f"{len(instance_env)} environments for {num_instances} instances")
        self.gmanager: subprocess.Popen | None = None
        self.gmanager_socket = self.socket_dir / "gmanager.sock"
        if gmanager_perf_model is not None:
            args = [sys.executable, "-m", "infinite_llm.scheduler.gmanager", "--state-dir", str(self.state_dir),
                    "--perf-model", str(gmanager_perf_model), "--http-port", "0",
                    "--socket-path", str(self.gmanager_socket), *(gmanager_args or [])]
            with open(root / "gmanager.log", "w") as log:
                self.gmanager = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                                 start_new_session=True)
        for inst_id in range(1, num_instances + 1):
            socket_path = self.socket_dir / f"infinited-{inst_id}.sock"
            log_path = root / f"infinited-{inst_id}.log"
            args = [sys.executable, "-m", "infinite_llm.daemon", "--instance-id", str(inst_id),
                    "--kv-pool-blocks", str(pools[inst_id - 1]), "--block-size", "16",
                    "--max-num-batched-tokens", str(max_num_batched_tokens), "--device", devices[inst_id - 1],
                    "--http-port", "0", "--socket-path", str(socket_path), "--state-dir", str(self.state_dir),
                    "--peer-host", "127.0.0.1", *(extra_args or []), *instance_args[inst_id - 1]]
            own_env = dict(env, **instance_env[inst_id - 1])
            self._launch[inst_id] = (args, own_env)
            with open(log_path, "w") as log:
                process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=own_env,
                                           start_new_session=True)
            self.instances[inst_id] = Instance(inst_id, process, socket_path, log_path)

    def restart(self, inst_id: int, extra_env: dict[str, str] | None = None, timeout_s: float = START_TIMEOUT_S) -> Instance:
        """Start instance ``inst_id`` again, as it was started (plus ``extra_env``), once its
        process has ended (killed by a test); returns it once it serves again. Its log goes on
        in the same file."""
        inst = self.instances[inst_id]
        if inst.process.poll() is None:
            raise RuntimeError(f"instance {inst_id} is still running")
        args, env = self._launch[inst_id]
        before = inst.process.pid
        with open(inst.log_path, "a") as log:
            process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=dict(env, **(extra_env or {})),
                                       start_new_session=True)
        inst.process = process
        member_path = self.state_dir / "members" / f"{inst_id}.json"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"instance {inst_id} exited: {inst.log_path.read_text()[-3000:]}")
            try:
                member = json.loads(member_path.read_text())
            except (OSError, ValueError):
                member = {}
            if member.get("pid") == process.pid and member.get("pid") != before:
                inst.http_port = member["http_port"]
                return inst
            time.sleep(0.2)
        raise TimeoutError(f"instance {inst_id} did not serve again within {timeout_s} s")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every instance has published itself and sees every other one as a peer."""
        deadline = time.monotonic() + timeout_s
        members = self.state_dir / "members"
        while time.monotonic() < deadline:
            for inst in self.instances.values():
                if inst.process.poll() is not None:
                    raise RuntimeError(f"instance {inst.inst_id} exited: {inst.log_path.read_text()[-3000:]}")
            if self.gmanager is not None and self.gmanager.poll() is not None:
                raise RuntimeError(f"the gManager exited: {(self.root / 'gmanager.log').read_text()[-3000:]}")
            found = {}
            for path in members.glob("*.json") if members.is_dir() else []:
                try:
                    found[int(path.stem)] = json.loads(path.read_text())
                except (ValueError, OSError):
                    continue
            if set(found) >= set(self.instances) and (self.gmanager is None or self.gmanager_socket.exists()):
                for inst_id, member in found.items():
                    if inst_id in self.instances:
                        self.instances[inst_id].http_port = member["http_port"]
                # One more upkeep period so that everyone has read everyone's entry.
                time.sleep(2.5)
                return
            time.sleep(0.5)
        raise TimeoutError(f"the cluster did not start within {timeout_s} s")

    def gmanager_status(self) -> dict[str, Any]:
        """The gManager's ``GET /v1/status`` (its leader view: instances, moves by result)."""
        conn = UnixHTTPConnection(str(self.gmanager_socket), timeout=30)
        try:
            conn.request("GET", "/v1/status")
            response = conn.getresponse()
            body = json.loads(response.read())
        finally:
            conn.close()
        if response.status != 200:
            raise RuntimeError(f"gManager status failed ({response.status}): {body}")
        return body

    def stop(self) -> None:
        processes = [inst.process for inst in self.instances.values()]
        processes += [self.gmanager] if self.gmanager is not None else []
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in processes:
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        shutil.rmtree(self.socket_dir, ignore_errors=True)

    def __iter__(self) -> Iterator[Instance]:
        return iter(self.instances.values())

    def __getitem__(self, inst_id: int) -> Instance:
        return self.instances[inst_id]


def passkey_prompt(num_items: int, key_item: int = 42) -> str:
    colours = ["red", "blue", "green", "amber"]
    doc = " ".join(f"Item {i}: the colour of box {i} is {colours[i % 4]}." for i in range(num_items))
    return doc + f" Question: what is the colour of box {key_item}? Answer: The colour of box {key_item} is"


class Generation:
    """One greedy request (``ignore_eos``) streamed from an instance in a thread; keeps its
    tokens, finish reason and error. Every wait is bounded by ``timeout_s``."""

    def __init__(self, instance: Instance, prompt: str, max_tokens: int, timeout_s: float = 120.0) -> None:
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self.error: BaseException | None = None
        self.timeout_s = timeout_s
        self.thread = threading.Thread(target=self._run, args=(instance, prompt, max_tokens), daemon=True)
        self.thread.start()

    def _run(self, instance: Instance, prompt: str, max_tokens: int) -> None:
        try:
            for step in instance.stream(prompt, timeout=self.timeout_s, max_tokens=max_tokens, ignore_eos=True):
                self.tokens.extend(step["token_ids"])
                self.finish_reason = step.get("finish_reason") or self.finish_reason
        except BaseException as exc:  # reported by join
            self.error = exc

    def join(self) -> list[int]:
        self.thread.join(timeout=self.timeout_s)
        assert not self.thread.is_alive() and self.error is None, self.error
        return self.tokens


def wait_for(what: str, condition: Callable[[], Any], timeout_s: float = 120.0, interval_s: float = 0.1) -> Any:
    """Poll ``condition`` until it returns something true (returned); TimeoutError naming
    ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"{what} within {timeout_s} s")
