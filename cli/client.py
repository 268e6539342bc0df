"""The client library behind `infctl`: find the cluster and talk to it.

Everything here is usable from Python. The gManager leader and the instances publish where they
listen in the state folder (`gmanager/leader.json`, `members/<id>.json`), or in etcd when the
cluster runs with it (`<prefix>/gmanager/leader`, `<prefix>/members/<id>`, read once per
lookup with a bounded wait). Their admin APIs are HTTP over Unix sockets, so commands reach the
daemons of the host they run on.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from dataclasses import asdict
from typing import Any, Iterable, Iterator

from infinite_llm.daemon.etcd_discovery import (
    DEFAULT_PREFIX,
    DEFAULT_REQUEST_TIMEOUT_S,
    EtcdKeys,
    EtcdUnreachable,
    parse_endpoints,
    read_cluster,
)
from infinite_llm.daemon.local_cluster import UnixHTTPConnection
from infinite_llm.daemon.membership import process_alive


class ClusterError(Exception):
    """A failure the CLI reports in one line, with its exit code."""

    exit_code = 1


class Unreachable(ClusterError):
    """No leader, or a daemon that does not answer."""

    exit_code = 3


class TimedOut(ClusterError):
    exit_code = 4


class UsageError(ClusterError):
    """A bad argument, found before anything was asked of the cluster."""

    exit_code = 2


@dataclass(frozen=True)
class Endpoint:
    """A daemon's admin API."""

    name: str
    pid: int
    socket_path: str

    def call(self, method: str, path: str, body: Any = None, timeout_s: float = 30.0) -> Any:
        try:
            conn = UnixHTTPConnection(self.socket_path, timeout=timeout_s)
            conn.request(method, path, body=None if body is None else json.dumps(body).encode(),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read()
            conn.close()
        except OSError as exc:
            raise Unreachable(f"{self.name} at {self.socket_path} does not answer: {exc}") from None
        try:
            data = json.loads(raw) if raw else {}
        except ValueError:  # not the daemon's JSON (an unmapped failure's text, a proxy's page)
            text = raw.decode("utf-8", "replace").strip()
            raise ClusterError(f"{self.name} answered HTTP {response.status} with no JSON: {text[:200]!r}") from None
        if response.status >= 400:
            message = data.get("error") if isinstance(data, dict) else data
            if isinstance(message, dict):
                message = message.get("message", message)
            raise ClusterError(f"{self.name}: {message} (HTTP {response.status})")
        return data


class ClusterClient:
    """The cluster whose daemons share ``state_dir``, or that register in etcd.

    ``etcd_endpoints``: ``host:port`` strings (or one comma-separated string); when given, the
    leader and the instances are looked up in etcd under ``etcd_prefix``, each read bounded by
    ``etcd_timeout_s`` seconds. ``state_dir`` then serves only the local-cluster helpers.
    """

    def __init__(self, state_dir: Path | str, etcd_endpoints: str | Iterable[str] = (),
                 etcd_prefix: str = DEFAULT_PREFIX, etcd_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S) -> None:
        self.state_dir = Path(state_dir)
        given = etcd_endpoints.split(",") if isinstance(etcd_endpoints, str) else list(etcd_endpoints)
        try:
            pairs = parse_endpoints(given) if any(e.strip() for e in given) else ()
            EtcdKeys(etcd_prefix)  # refuses a malformed prefix
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        self.etcd_endpoints = tuple(f"{host}:{port}" for host, port in pairs)
        self.etcd_prefix = etcd_prefix
        self.etcd_timeout_s = etcd_timeout_s

    @property
    def location(self) -> str:
        """Where the cluster is looked up, for messages."""
        if self.etcd_endpoints:
            return f"etcd at {','.join(self.etcd_endpoints)} (prefix {self.etcd_prefix})"
        return str(self.state_dir)

    def _read_etcd(self):
        try:
            return asyncio.run(read_cluster(self.etcd_endpoints, self.etcd_prefix, self.etcd_timeout_s))
        except EtcdUnreachable as exc:
            raise Unreachable(str(exc)) from None
        except TimeoutError:
            raise Unreachable(f"etcd at {','.join(self.etcd_endpoints)} did not answer within "
                              f"{self.etcd_timeout_s:g} s") from None

    # ---- discovery ----------------------------------------------------------------------
    def instances(self) -> dict[int, dict[str, Any]]:
        """Live instances by id, as they published themselves."""
        if self.etcd_endpoints:  # live: etcd deletes a record whose lease expired
            _, members = self._read_etcd()
            return {inst_id: asdict(member) for inst_id, member in sorted(members.items())}
        found = {}
        for path in sorted((self.state_dir / "members").glob("*.json")):
            try:
                member = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if process_alive(int(member.get("pid", 0))):
                found[int(member["inst_id"])] = member
        return found

    def instance(self, inst_id: int) -> Endpoint:
        member = self.instances().get(inst_id)
        if member is None:
            raise Unreachable(f"no live instance {inst_id} in {self.location}")
        return Endpoint(f"instance {inst_id}", int(member["pid"]), member["socket_path"])

    def leader(self) -> Endpoint:
        if self.etcd_endpoints:
            info, _ = self._read_etcd()
            if info is None:
                raise Unreachable(f"no gManager leader in {self.location}")
            return Endpoint(f"gManager (epoch {info.epoch})", info.pid, info.socket_path)
        path = self.state_dir / "gmanager" / "leader.json"
        try:
            leader = json.loads(path.read_text())
        except (OSError, ValueError):
            raise Unreachable(f"no gManager leader in {self.state_dir}") from None
        if not process_alive(int(leader.get("pid", 0))) or not leader.get("socket_path"):
            raise Unreachable(f"the gManager leader recorded in {path} is gone")
        return Endpoint(f"gManager (epoch {leader['epoch']})", int(leader["pid"]), leader["socket_path"])

    # ---- reads --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The cluster as the leader sees it, with each instance's own pool and requests."""
        try:
            cluster = self.leader().call("GET", "/v1/status")
        except Unreachable as exc:
            if not self.instances():
                raise Unreachable(f"no cluster runs in {self.location}: no leader and no instance") from None
            cluster = {"leader": None, "error": str(exc)}
        cluster["instances_detail"] = {
            inst_id: self.instance(inst_id).call("GET", "/v1/status") for inst_id in self.instances()}
        return cluster

    def instance_status(self, inst_id: int) -> dict[str, Any]:
        return self.instance(inst_id).call("GET", "/v1/status")

    # ---- commands -----------------------------------------------------------------------
    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self.leader().call("POST", "/v1/rebalance", {"dry_run": dry_run}, timeout_s=120.0)

    def drain(self, inst_id: int, timeout_s: float, dry_run: bool = False, poll_s: float = 0.5) -> dict[str, Any]:
        """Cordon the instance, move its work off and wait until it is safe to stop.

        Through the gManager leader: it refuses (ClusterError, nothing moved) when the other
        instances lack room or the instance is unknown, cordons the instance, moves every
        segment it holds for others and its requests' full blocks away, and reports safe to stop
        once nothing runs there and it holds nothing. A dry run returns the planned moves. On
        timeout (TimedOut) the instance stays cordoned and the gManager goes on draining it.

        With no leader, the instance's own API: cordon, and wait until its requests finished
        and their homes freed what it holds (nothing is moved, so this may wait long).
        """
        if not (math.isfinite(timeout_s) and timeout_s > 0):  # before anything is cordoned
            raise UsageError(f"the timeout must be a number of seconds > 0, got {timeout_s}")
        try:
            leader = self.leader()
        except Unreachable:
            return self._drain_without_leader(inst_id, timeout_s, dry_run)
        report = leader.call("POST", "/v1/drain", {"instance_id": inst_id, "dry_run": dry_run}, timeout_s=60.0)
        if dry_run:
            return report
        deadline = time.monotonic() + timeout_s
        while not report["safe_to_stop"]:
            if report.get("state") == "stopped":  # it left, holding nothing for others
                return report
            if report.get("state") == "lost":
                raise ClusterError(f"instance {inst_id} went silent before it was drained")
            if time.monotonic() >= deadline:
                raise TimedOut(self._not_drained(inst_id, report, timeout_s))
            time.sleep(poll_s)
            report = leader.call("GET", f"/v1/drain/{inst_id}")
        return report

    def _not_drained(self, inst_id: int, report: dict[str, Any], timeout_s: float) -> str:
        """Why a drain is not done, from the instance's own figures when it answers."""
        running, held = report.get("running_requests", 0), report.get("blocks_held_for_others", 0)
        try:
            status = self.instance(inst_id).call("GET", "/v1/status", timeout_s=5.0)
            running = len(status["requests"])
            held = status["pool"]["num_blocks_held_for_others"] + status["pool"]["num_blocks_reserved_for_others"]
        except ClusterError:
            pass  # the gManager's figures, from the last heartbeats
        return (f"instance {inst_id} still runs {running} request(s) and holds {held} block(s) for others "
                f"after {timeout_s:g} s; it stays cordoned")

    def _drain_without_leader(self, inst_id: int, timeout_s: float, dry_run: bool) -> dict[str, Any]:
        endpoint = self.instance(inst_id)
        if dry_run:
            status = endpoint.call("GET", "/v1/status")
            return {"instance_id": inst_id, "dry_run": True, "moves": [], "running_requests": len(status["requests"]),
                    "blocks_held_for_others": status["pool"]["num_blocks_held_for_others"]}
        deadline = time.monotonic() + timeout_s
        while True:
            report = endpoint.call("POST", "/v1/drain")
            if report["safe_to_stop"]:
                return report
            if time.monotonic() >= deadline:
                raise TimedOut(f"instance {inst_id} still runs {report['running_requests']} request(s) and holds "
                               f"{report['blocks_held_for_others']} block(s) for others after {timeout_s:g} s "
                               f"(no gManager leader: nothing was moved off it); it stays cordoned")
            time.sleep(0.2)

    def uncordon(self, inst_id: int) -> dict[str, Any]:
        """Admit requests again: through the leader (which calls off its drain), else locally."""
        try:
            leader = self.leader()
        except Unreachable:
            return self.instance(inst_id).call("POST", "/v1/uncordon")
        return leader.call("POST", "/v1/uncordon", {"instance_id": inst_id})

    def generate(self, prompt: str | list[dict[str, str]], inst_id: int | None = None,
                 **params: Any) -> Iterator[dict[str, Any]]:
        """Stream a request's steps from one instance (default: the one with the most free blocks).

        ``prompt``: text, or chat messages (rendered with the model's template).
        """
        members = self.instances()
        if not members:
            raise Unreachable(f"no live instance in {self.location}")
        if inst_id is None:
            inst_id = max(members, key=lambda i: (members[i]["num_blocks_free"], -i))
        endpoint = self.instance(inst_id)
        conn = UnixHTTPConnection(endpoint.socket_path, timeout=600)
        body = {"messages" if isinstance(prompt, list) else "prompt": prompt, "params": params}
        conn.request("POST", "/v1/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise ClusterError(f"instance {inst_id}: {json.loads(response.read()).get('error')}")
        for line in response:
            if line.strip():
                yield json.loads(line)
        conn.close()

    # ---- a local cluster ----------------------------------------------------------------
    def up(self, num_instances: int, pool_blocks: int, model: str | None, device: str,
           perf_model: Path | None, timeout_s: float = 300.0, log=print, max_num_batched_tokens: int = 512) -> None:
        """Start a gManager and ``num_instances`` instances on this machine, in the background."""
        if self.instances():
            raise ClusterError(f"a cluster already runs in {self.state_dir}: `infctl down` first")
        run_dir = self.state_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["UCX_TLS"] = "tcp,sm,self"
        if perf_model is not None:
            args = [sys.executable, "-m", "infinite_llm.scheduler.gmanager", "--state-dir", str(self.state_dir),
                    "--perf-model", str(perf_model), "--http-port", "0", "--socket-path", str(run_dir / "gmanager.sock")]
            _spawn(args, run_dir / "gmanager.log", env)
        for inst_id in range(1, num_instances + 1):
            args = [sys.executable, "-m", "infinite_llm.daemon", "--instance-id", str(inst_id),
                    "--kv-pool-blocks", str(pool_blocks), "--device", device, "--http-port", "0",
                    "--max-num-batched-tokens", str(max_num_batched_tokens),
                    "--socket-path", str(run_dir / f"infinited-{inst_id}.sock"), "--state-dir", str(self.state_dir)]
            if model:
                args += ["--model", model]
            _spawn(args, run_dir / f"infinited-{inst_id}.log", env)
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            count = len(self.instances())
            if count != seen:
                seen = count
                log(f"{count}/{num_instances} instances ready")
            if count == num_instances:
                # One more membership period, so that every instance has read every other's entry.
                time.sleep(2.5)
                return
            time.sleep(0.5)
        raise TimedOut(f"only {seen} of {num_instances} instances came up in {timeout_s:g} s; logs in {run_dir}")

    def down(self, timeout_s: float = 60.0) -> int:
        """Stop every daemon of the cluster (SIGTERM, then SIGKILL after ``timeout_s``)."""
        pids = [int(m["pid"]) for m in self.instances().values()]
        try:
            pids.append(self.leader().pid)
        except Unreachable:
            pass
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
        return len(pids)


def _spawn(args: list[str], log_path: Path, env: dict[str, str]) -> None:
    with open(log_path, "ab") as log:
        subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                         start_new_session=True)
