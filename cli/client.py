"""The client library behind `infctl`: find the cluster and talk to it.

Everything here is usable from Python. The gManager leader and the instances publish where they
listen in the state folder (`gmanager/leader.json`, `members/<id>.json`), or in etcd when the
cluster runs with it (`<prefix>/gmanager/leader`, `<prefix>/members/<id>`, read once per
lookup with a bounded wait). Their admin APIs are HTTP over Unix sockets, so commands reach the
daemons of the host they run on.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

from infinite_llm.daemon.config import Timeouts
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

# An instance rewrites its record every heartbeat period and the daemons drop a record older
# than five periods (daemon/membership.py): the CLI reads the folder by the same rule.
DEFAULT_STALE_AFTER_S = 5 * Timeouts().heartbeat_interval_s
GENERATE_TIMEOUT_S = 600.0  # the longest `generate` waits for an instance's next step, s


class ClusterError(Exception):
    """A failure the CLI reports in one line, with its exit code."""

    exit_code = 1


class Unreachable(ClusterError):
    """No leader, or a daemon that does not answer."""

    exit_code = 3


class NotLeader(Unreachable):
    """The gManager recorded as the leader answers that it is a standby."""


class TimedOut(ClusterError):
    exit_code = 4


class Refused(ClusterError):
    """A daemon answered with an HTTP error: ``status`` is its code, ``detail`` its own words."""

    def __init__(self, message: str, status: int, detail: str) -> None:
        super().__init__(message)
        self.status = status
        self.detail = detail


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
            raise self.unreachable(exc) from None
        return _decode_answer(self.name, response.status, raw)

    def unreachable(self, exc: OSError) -> Unreachable:
        return Unreachable(f"{self.name} at {self.socket_path} does not answer: {exc}")


def _decode_answer(name: str, status: int, raw: bytes) -> Any:
    """A daemon's JSON answer, or the ClusterError its HTTP error or non-JSON body stands for."""
    try:
        data = json.loads(raw) if raw else {}
    except ValueError:  # not the daemon's JSON (an unmapped failure's text, a proxy's page)
        text = raw.decode("utf-8", "replace").strip()
        raise ClusterError(f"{name} answered HTTP {status} with no JSON: {text[:200]!r}") from None
    if status >= 400:
        message = data.get("error") if isinstance(data, dict) else data
        if isinstance(message, dict):
            message = message.get("message", message)
        raise Refused(f"{name}: {message} (HTTP {status})", status, str(message))
    return data


class ClusterClient:
    """The cluster whose daemons share ``state_dir``, or that register in etcd.

    ``etcd_endpoints``: ``host:port`` strings (or one comma-separated string); when given, the
    leader and the instances are looked up in etcd under ``etcd_prefix``, each read bounded by
    ``etcd_timeout_s`` seconds. ``state_dir`` then serves only the local-cluster helpers.
    ``stale_after_s``: a record in the state folder not rewritten for this long is left out, as
    the daemons leave it out (its instance is hung or was killed).
    """

    def __init__(self, state_dir: Path | str, etcd_endpoints: str | Iterable[str] = (),
                 etcd_prefix: str = DEFAULT_PREFIX, etcd_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S) -> None:
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
        self.stale_after_s = stale_after_s

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
        now = time.time()
        return {inst_id: member for inst_id, member in self._member_records().items()
                if now - member["updated_at"] <= self.stale_after_s and process_alive(member["pid"])}

    def _member_records(self) -> dict[int, dict[str, Any]]:
        """Every record in the state folder by instance id, stale or not."""
        found = {}
        for path in sorted((self.state_dir / "members").glob("*.json")):
            try:
                member = json.loads(path.read_text())
                inst_id, pid, updated_at = int(member["inst_id"]), int(member["pid"]), float(member["updated_at"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # half-written by a crashed writer or not ours
            found[inst_id] = {**member, "inst_id": inst_id, "pid": pid, "updated_at": updated_at}
        return found

    def instance(self, inst_id: int) -> Endpoint:
        member = self.instances().get(inst_id)
        if member is None:
            raise Unreachable(f"no live instance {inst_id} in {self.location}")
        return _instance_endpoint(member)

    def leader(self) -> Endpoint:
        if self.etcd_endpoints:
            info, _ = self._read_etcd()
            if info is None:
                raise Unreachable(f"no gManager leader in {self.location}")
            return Endpoint(f"gManager (epoch {info.epoch})", info.pid, info.socket_path)
        path = self._leader_path
        try:
            leader = json.loads(path.read_text())
        except (OSError, ValueError):
            raise Unreachable(f"no gManager leader in {self.state_dir}") from None
        if not process_alive(int(leader.get("pid", 0))) or not leader.get("socket_path"):
            raise Unreachable(f"the gManager leader recorded in {path} is gone")
        return Endpoint(f"gManager (epoch {leader['epoch']})", int(leader["pid"]), leader["socket_path"])

    @property
    def _leader_path(self) -> Path:
        return self.state_dir / "gmanager" / "leader.json"

    def _call_leader(self, leader: Endpoint, method: str, path: str, body: Any = None,
                     timeout_s: float = 30.0) -> Any:
        """``leader.call``; a standby's answer (HTTP 503) means the leader record is out of date."""
        try:
            return leader.call(method, path, body, timeout_s=timeout_s)
        except Refused as exc:
            if exc.status != 503:
                raise
            where = self.location if self.etcd_endpoints else self._leader_path
            raise NotLeader(f"{leader.name}, pid {leader.pid}, recorded as the leader in {where}, does not lead: "
                            f"{exc.detail}") from None

    # ---- reads --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        """The cluster as the leader sees it, with each instance's own pool and requests.

        An instance that does not answer is listed under ``instances_unreachable`` (id: why), one
        that answers with an error under ``instances_failed``; the others under ``instances_detail``.
        """
        try:
            cluster = self.leader().call("GET", "/v1/status")
        except Unreachable as exc:
            if not self.instances():
                raise Unreachable(f"no cluster runs in {self.location}: no leader and no instance") from None
            cluster = {"leader": None, "error": str(exc)}
        detail, unreachable, failed = {}, {}, {}
        for inst_id, member in self.instances().items():
            try:
                detail[inst_id] = _instance_endpoint(member).call("GET", "/v1/status")
            except Unreachable as exc:
                unreachable[inst_id] = str(exc)
            except ClusterError as exc:
                failed[inst_id] = str(exc)
        cluster["instances_detail"] = detail
        cluster["instances_unreachable"] = unreachable
        cluster["instances_failed"] = failed
        return cluster

    def instance_status(self, inst_id: int) -> dict[str, Any]:
        return self.instance(inst_id).call("GET", "/v1/status")

    # ---- commands -----------------------------------------------------------------------
    def rebalance(self, dry_run: bool) -> dict[str, Any]:
        return self._call_leader(self.leader(), "POST", "/v1/rebalance", {"dry_run": dry_run}, timeout_s=120.0)

    def drain(self, inst_id: int, timeout_s: float, dry_run: bool = False, poll_s: float = 0.5) -> dict[str, Any]:
        """Cordon the instance, move its work off and wait until it is safe to stop.

        Through the gManager leader: it refuses (ClusterError, nothing moved) when the other
        instances lack room or the instance is unknown, cordons the instance, moves every
        segment it holds for others and its requests' full blocks away, and reports safe to stop
        once nothing runs there and it holds nothing. A dry run returns the planned moves. On
        timeout (TimedOut) the instance stays cordoned and the gManager goes on draining it; a
        drain called off meanwhile (`uncordon`) is a ClusterError at once.

        With no leader, the instance's own API: cordon, and wait until its requests finished
        and their homes freed what it holds (nothing is moved, so this may wait long).
        """
        if not (math.isfinite(timeout_s) and timeout_s > 0):  # before anything is cordoned
            raise UsageError(f"the timeout must be a number of seconds > 0, got {timeout_s}")
        try:
            leader = self.leader()
        except Unreachable:
            return self._drain_without_leader(inst_id, timeout_s, dry_run)
        report = self._call_leader(leader, "POST", "/v1/drain", {"instance_id": inst_id, "dry_run": dry_run},
                                   timeout_s=60.0)
        if dry_run:
            return report
        deadline = time.monotonic() + timeout_s
        while not report["safe_to_stop"]:
            if report.get("state") == "stopped":  # it left, holding nothing for others
                return report
            if report.get("state") == "lost":
                raise ClusterError(f"instance {inst_id} went silent before it was drained")
            if report.get("state") == "not_draining":  # an `uncordon` from elsewhere ended it
                raise ClusterError(f"the drain of instance {inst_id} was called off (uncordoned) before it was "
                                   f"done; the instance admits requests again")
            if time.monotonic() >= deadline:
                raise TimedOut(self._not_drained(inst_id, report, timeout_s))
            time.sleep(poll_s)
            report = self._call_leader(leader, "GET", f"/v1/drain/{inst_id}")
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
        return self._call_leader(leader, "POST", "/v1/uncordon", {"instance_id": inst_id})

    def generate(self, prompt: str | list[dict[str, str]], inst_id: int | None = None,
                 timeout_s: float = GENERATE_TIMEOUT_S, prefill: dict[str, Any] | None = None,
                 **params: Any) -> Iterator[dict[str, Any]]:
        """Stream a request's steps from one instance (default: the one with the most free blocks).

        ``prompt``: text, or chat messages (rendered with the model's template). ``timeout_s``:
        the longest wait for the first step (a queued request waits for room) or the next one;
        past it, TimedOut, and the closed connection cancels the request. ``prefill``: the local
        API's prefill object (``{"mode": "apb", "query": ...}``; None: exact); the first step then
        says how the prompt was prefilled (``step["prefill"]``). A request that fails
        on the instance (finish reason "error" or "abort"), or whose stream ends before its last
        step, is a ClusterError after the steps it made.
        """
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"the timeout must be a number of seconds > 0, got {timeout_s}")
        members = self.instances()
        if not members:
            raise Unreachable(f"no live instance in {self.location}")
        if inst_id is None:
            inst_id = max(members, key=lambda i: (members[i]["num_blocks_free"], -i))
        if inst_id not in members:
            raise Unreachable(f"no live instance {inst_id} in {self.location}")
        endpoint = _instance_endpoint(members[inst_id])
        body = {"messages" if isinstance(prompt, list) else "prompt": prompt, "params": params}
        if prefill is not None:
            body["prefill"] = prefill
        conn = UnixHTTPConnection(endpoint.socket_path, timeout=timeout_s)
        try:
            try:
                conn.connect()
            except OSError as exc:
                raise endpoint.unreachable(exc) from None
            try:
                conn.request("POST", "/v1/generate", body=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    _decode_answer(endpoint.name, response.status, response.read())
                    raise ClusterError(f"{endpoint.name} answered HTTP {response.status}")
                finished = False
                for line in response:
                    if not line.strip():
                        continue
                    step = _decode_step(endpoint.name, line)
                    if step.get("finish_reason") in ("error", "abort"):
                        raise ClusterError(
                            f"{endpoint.name}: request {step.get('request_id')} failed after "
                            f"{step.get('completion_tokens', 0)} token(s) (finish reason {step['finish_reason']!r}); "
                            f"the instance's log says why")
                    yield step
                    finished = bool(step.get("finished"))
            except TimeoutError:
                raise TimedOut(f"{endpoint.name} sent nothing for {timeout_s:g} s (a request waits while the "
                               f"instance has no room for it); the request is cancelled") from None
            except OSError as exc:
                raise Unreachable(f"{endpoint.name} at {endpoint.socket_path} went away during the request: "
                                  f"{exc}") from None
            except http.client.HTTPException as exc:  # the stream broke off mid-chunk
                raise Unreachable(f"{endpoint.name} broke off the stream: {type(exc).__name__}") from None
            if not finished:
                raise ClusterError(f"{endpoint.name} closed the stream before the request finished")
        finally:
            conn.close()

    # ---- a local cluster ----------------------------------------------------------------
    def up(self, num_instances: int, pool_blocks: int, model: str | None, device: str,
           perf_model: Path | None, timeout_s: float = 300.0, log=print, max_num_batched_tokens: int = 512) -> None:
        """Start a gManager and ``num_instances`` instances on this machine, in the background.

        Returns once every instance published itself and, with ``perf_model``, the gManager
        published itself as the leader. A daemon that exits meanwhile, or the timeout, is a
        ClusterError (with the end of the daemon's log) and stops every daemon started here.
        """
        leader_pid = self._leader_pid()
        gmanager_runs = leader_pid is not None and _is_daemon_of(leader_pid, "infinite-gmanager", self.state_dir)
        if self.instances() or gmanager_runs:
            raise ClusterError(f"a cluster already runs in {self.state_dir}: `infctl down` first")
        run_dir = self.state_dir / "run"
        run_dir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        if device == "cpu":
            env["UCX_TLS"] = "tcp,sm,self"
        started: list[_Started] = []
        gmanager = None
        if perf_model is not None:
            args = [sys.executable, "-m", "infinite_llm.scheduler.gmanager", "--state-dir", str(self.state_dir),
                    "--perf-model", str(perf_model), "--http-port", "0", "--socket-path", str(run_dir / "gmanager.sock")]
            gmanager = _spawn("the gManager", args, run_dir / "gmanager.log", env)
            started.append(gmanager)
        for inst_id in range(1, num_instances + 1):
            args = [sys.executable, "-m", "infinite_llm.daemon", "--instance-id", str(inst_id),
                    "--kv-pool-blocks", str(pool_blocks), "--device", device, "--http-port", "0",
                    "--max-num-batched-tokens", str(max_num_batched_tokens),
                    "--socket-path", str(run_dir / f"infinited-{inst_id}.sock"), "--state-dir", str(self.state_dir)]
            if model:
                args += ["--model", model]
            started.append(_spawn(f"instance {inst_id}", args, run_dir / f"infinited-{inst_id}.log", env))
        try:
            self._wait_started(started, gmanager, num_instances, timeout_s, log)
        except ClusterError:
            _stop(started)
            raise

    def _wait_started(self, started: list[_Started], gmanager: _Started | None, num_instances: int,
                      timeout_s: float, log: Callable[[str], Any]) -> None:
        deadline = time.monotonic() + timeout_s
        seen = 0
        while time.monotonic() < deadline:
            for daemon in started:
                if daemon.process.poll() is not None:
                    raise ClusterError(f"{daemon.name} exited with code {daemon.process.returncode} while starting; "
                                       f"every daemon started is stopped. The end of {daemon.log_path}:\n"
                                       f"{_log_tail(daemon.log_path)}")
            count = len(self.instances())
            if count != seen:
                seen = count
                log(f"{count}/{num_instances} instances ready")
            if count == num_instances and (gmanager is None or self._leader_pid() == gmanager.process.pid):
                # One more membership period, so that every instance has read every other's entry.
                time.sleep(2.5)
                return
            time.sleep(0.5)
        waiting = f"only {seen} of {num_instances} instances came up"
        if seen == num_instances:
            waiting = "the gManager did not publish itself as the leader"
        raise TimedOut(f"{waiting} in {timeout_s:g} s; every daemon started is stopped; logs in "
                       f"{started[0].log_path.parent}")

    def _leader_pid(self) -> int | None:
        """The pid in the state folder's leader record, whether or not it lives."""
        try:
            return int(json.loads(self._leader_path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def down(self, timeout_s: float = 60.0, log: Callable[[str], Any] = print) -> int:
        """Stop every daemon of the cluster (SIGTERM, then SIGKILL after ``timeout_s``); how many.

        Only a process that is an infinited or a gManager of this state folder by its command
        line is signalled: a record left by a killed daemon may name a pid that the system gave
        to another process since (it is skipped, and said with ``log``). A signal refused (a
        daemon of another user) does not stop the others; it is a ClusterError once they are.
        """
        daemons = {f"instance {inst_id}": (member["pid"], "infinited")
                   for inst_id, member in self._member_records().items()}
        leader_pid = self._leader_pid()
        if leader_pid is not None:
            daemons["the gManager"] = (leader_pid, "infinite-gmanager")
        signalled, refused = [], []
        for name, (pid, program) in daemons.items():
            if not _is_running(pid):
                continue
            if not _is_daemon_of(pid, program, self.state_dir):
                log(f"left pid {pid} alone: {name}'s record names it, but it does not run {program} over "
                    f"{self.state_dir} (the daemon that wrote the record is gone; its pid was reused)")
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            except PermissionError as exc:
                refused.append(f"{name} (pid {pid}): {exc.strerror}")
                continue
            signalled.append(pid)
        deadline = time.monotonic() + timeout_s
        while any(_is_running(p) for p in signalled) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in signalled:
            if _is_running(pid):
                with contextlib.suppress(ProcessLookupError):  # it exited since
                    os.kill(pid, signal.SIGKILL)
        if refused:
            raise ClusterError(f"stopped {len(signalled)} daemon(s); could not signal {len(refused)}: "
                               f"{'; '.join(refused)}")
        return len(signalled)


def _instance_endpoint(member: dict[str, Any]) -> Endpoint:
    return Endpoint(f"instance {member['inst_id']}", int(member["pid"]), member["socket_path"])


def _decode_step(name: str, line: bytes) -> dict[str, Any]:
    try:
        step = json.loads(line)
    except ValueError:
        step = None
    if not isinstance(step, dict):
        text = line.decode("utf-8", "replace").strip()
        raise ClusterError(f"{name} streamed a line that is not a step: {text[:200]!r}")
    return step


# ---- local daemons ------------------------------------------------------------------------
# How `up` (python -m MODULE) and the packaged entry points (PROGRAM) start each daemon.
_DAEMON_MODULES = {"infinite_llm.daemon": "infinited", "infinite_llm.daemon.main": "infinited",
                   "infinite_llm.scheduler.gmanager": "infinite-gmanager"}
_DAEMON_PROGRAMS = {"infinited", "infinite-gmanager"}
_PYTHON_OPTIONS_WITH_VALUE = {"-W", "-X", "--check-hash-based-pycs"}


def daemon_program(argv: list[str]) -> tuple[str | None, list[str]]:
    """Which daemon a command line runs ("infinited", "infinite-gmanager" or None), and its arguments.

    ``argv``: a process's command line, interpreter first, as in ``/proc/<pid>/cmdline``.
    """
    skip_value = False
    for i, arg in enumerate(argv[1:], start=1):
        if skip_value:
            skip_value = False
        elif arg == "-m" and i + 1 < len(argv):
            return _DAEMON_MODULES.get(argv[i + 1]), argv[i + 2:]
        elif arg in _PYTHON_OPTIONS_WITH_VALUE:
            skip_value = True
        elif arg == "-c":
            return None, []
        elif not arg.startswith("-"):  # the script: what follows is its own arguments
            program = Path(arg).name
            return (program if program in _DAEMON_PROGRAMS else None), argv[i + 1:]
    return None, []


def _is_running(pid: int) -> bool:
    """Whether ``pid`` exists and has not exited: a daemon that is a child of this process (`up`
    and `down` from one Python program) stays a zombie until its parent reaps it."""
    if not process_alive(pid):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return process_alive(pid)  # no /proc to tell
    return stat[stat.rindex(")") + 2:].split(" ", 1)[0] != "Z"  # the state, after the command's name


def _is_daemon_of(pid: int, program: str, state_dir: Path) -> bool:
    """Whether ``pid`` runs ``program`` over ``state_dir`` (one started with ``--config`` and no
    ``--state-dir`` counts: its folder is in a file this cannot check)."""
    try:
        argv = [a.decode("utf-8", "replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:  # gone, or no /proc to tell: never signal what cannot be told
        return False
    running, args = daemon_program(argv)
    if running != program:
        return False
    for i, arg in enumerate(args):
        if arg == "--state-dir" and i + 1 < len(args):
            given = args[i + 1]
        elif arg.startswith("--state-dir="):
            given = arg.removeprefix("--state-dir=")
        else:
            continue
        if not os.path.isabs(given):  # as `up` passes a relative --state-dir: from the daemon's folder
            try:
                given = os.path.join(os.readlink(f"/proc/{pid}/cwd"), given)
            except OSError:
                return False
        return Path(given).resolve() == state_dir.resolve()
    return True


@dataclass(frozen=True)
class _Started:
    name: str  # "instance 2", "the gManager"
    process: subprocess.Popen
    log_path: Path


def _spawn(name: str, args: list[str], log_path: Path, env: dict[str, str]) -> _Started:
    with open(log_path, "ab") as log:
        process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
    return _Started(name, process, log_path)


def _stop(started: list[_Started], timeout_s: float = 10.0) -> None:
    """SIGTERM what ``up`` started, then SIGKILL what still runs after ``timeout_s``."""
    for daemon in started:
        if daemon.process.poll() is None:
            daemon.process.terminate()
    deadline = time.monotonic() + timeout_s
    for daemon in started:
        try:
            daemon.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            daemon.process.kill()
            daemon.process.wait()


def _log_tail(path: Path, num_lines: int = 10) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-num_lines:]
    except OSError as exc:
        return f"  (unreadable: {exc})"
    return "\n".join(f"  {line}" for line in lines) or "  (empty)"
