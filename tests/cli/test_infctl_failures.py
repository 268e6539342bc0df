"""`infctl` when something goes wrong: failed and timed-out requests, daemons that do not answer,
die at start or left stale records, drains called off and leader records that name a standby.

The daemons are stand-ins (`fake_daemons.py`) or real ones given a bad argument; every command
runs as its own process, as from a shell, and every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest
from typer.testing import CliRunner

from infinite_llm.cli.client import ClusterClient, daemon_program
from infinite_llm.cli.main import app

FAKE_DAEMONS = Path(__file__).with_name("fake_daemons.py")


def infctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "infinite_llm.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@contextlib.contextmanager
def running(args: list[str], wait_for_ready: bool = False, ready_timeout_s: float = 30.0) -> Iterator[subprocess.Popen]:
    """A process for the test's length; with ``wait_for_ready``, once it printed "ready"."""
    process = subprocess.Popen(args, stdout=subprocess.PIPE if wait_for_ready else subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        if wait_for_ready:
            deadline = time.monotonic() + ready_timeout_s
            line = b""
            while b"ready" not in line:
                remaining = deadline - time.monotonic()
                assert remaining > 0 and process.poll() is None, f"{args} did not start: {line!r}"
                if select.select([process.stdout], [], [], remaining)[0]:
                    line = process.stdout.readline()
        yield process
    finally:
        if process.poll() is None:
            process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def fake(role: str, state: Path, mode: str):
    return running([sys.executable, str(FAKE_DAEMONS), role, str(state), mode], wait_for_ready=True)


def sleeper():
    """An unrelated process, as one that got the pid of a daemon killed with SIGKILL."""
    return running(["sleep", "60"])


def fake_program(tmp_path: Path, program: str, state: Path):
    """A process whose command line is that of a packaged daemon entry point over ``state``."""
    script = tmp_path / "bin" / program
    script.parent.mkdir(exist_ok=True)
    script.write_text("import time\ntime.sleep(60)\n")
    return running([sys.executable, str(script), "--state-dir", str(state)])


def write_record(state: Path, inst_id: int, pid: int, socket_path: Path | None = None,
                 updated_at: float | None = None) -> None:
    """``members/<inst_id>.json`` as an instance publishes it (``updated_at``: now unless given)."""
    (state / "members").mkdir(parents=True, exist_ok=True)
    record = dict(inst_id=inst_id, pid=pid, peer_host="127.0.0.1", peer_port=1, http_port=0,
                  socket_path=str(socket_path or state / f"i{inst_id}.sock"), num_blocks_total=4, num_blocks_free=4,
                  draining=False, updated_at=time.time() if updated_at is None else updated_at)
    (state / "members" / f"{inst_id}.json").write_text(json.dumps(record))


def write_leader(state: Path, pid: int) -> None:
    (state / "gmanager").mkdir(parents=True, exist_ok=True)
    (state / "gmanager" / "leader.json").write_text(json.dumps({"pid": pid, "epoch": 1,
                                                                "socket_path": str(state / "gm.sock")}))


def processes_over(state: Path) -> list[int]:
    """The pids whose command line names ``state``."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(state).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # it ended meanwhile
    return found


def exit_status(process: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None


# ---- generate ---------------------------------------------------------------------------------
def test_generate_fails_when_the_request_fails_on_the_instance(tmp_path):
    """A last step with finish reason "error" is exit 1 and one line on stderr, after the text so far."""
    with fake("instance", tmp_path, "error"):
        failed = infctl("generate", "hi", "--state-dir", str(tmp_path))
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert failed.stdout == "The pass key\n"
    assert failed.stderr.count("\n") == 1 and "request 1 failed after 3 token(s)" in failed.stderr, failed.stderr

    with fake("instance", tmp_path, "ok"):
        done = infctl("generate", "hi", "--state-dir", str(tmp_path))
    assert done.returncode == 0 and done.stdout == "The pass key is 1.\n", done.stdout + done.stderr


def test_generate_to_an_instance_that_does_not_answer_is_exit_3(tmp_path):
    """No socket, or one nobody listens on: "does not answer", as `status` says it (exit 3)."""
    write_record(tmp_path, 1, os.getpid(), socket_path=tmp_path / "gone.sock")
    missing = infctl("generate", "hi", "--state-dir", str(tmp_path))
    assert missing.returncode == 3, missing.stderr
    assert f"instance 1 at {tmp_path / 'gone.sock'} does not answer" in missing.stderr
    assert "FileNotFoundError" not in missing.stderr and "Traceback" not in missing.stderr

    refusing = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    refusing.bind(str(tmp_path / "refusing.sock"))  # bound, never listening: connections are refused
    try:
        write_record(tmp_path, 1, os.getpid(), socket_path=tmp_path / "refusing.sock")
        refused = infctl("generate", "hi", "--state-dir", str(tmp_path))
    finally:
        refusing.close()
    assert refused.returncode == 3 and "does not answer" in refused.stderr, refused.stderr
    assert "ConnectionRefusedError" not in refused.stderr


def test_generate_reports_an_error_answer_that_is_not_json(tmp_path):
    with fake("instance", tmp_path, "text500"):
        result = infctl("generate", "hi", "--state-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "instance 1 answered HTTP 500 with no JSON" in result.stderr
    assert "JSONDecodeError" not in result.stderr and "Traceback" not in result.stderr


def test_generate_reports_what_failed_in_an_instance(tmp_path):
    """An unexpected failure in the daemon comes back as a JSON error that names it."""
    with fake("instance", tmp_path, "crash"):
        result = infctl("generate", "hi", "--state-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    assert "internal error: RuntimeError: scripted failure" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_gives_up_after_its_timeout(tmp_path):
    """A request queued past the client's wait is exit 4 with a message, not a TimeoutError."""
    with fake("instance", tmp_path, "silent"):
        started = time.monotonic()
        result = infctl("generate", "hi", "--timeout", "1", "--state-dir", str(tmp_path))
        elapsed = time.monotonic() - started
    assert result.returncode == 4, result.stderr
    assert "instance 1 sent nothing for 1 s" in result.stderr and "TimeoutError" not in result.stderr
    assert elapsed < 20


# ---- status -----------------------------------------------------------------------------------
def test_status_shows_every_instance_and_marks_the_one_that_does_not_answer(tmp_path):
    with fake("instance", tmp_path, "ok"):
        write_record(tmp_path, 2, os.getpid(), socket_path=tmp_path / "gone.sock")
        table = infctl("status", "--state-dir", str(tmp_path))
        as_json = infctl("status", "--json", "--state-dir", str(tmp_path))
    assert table.returncode == 3, table.stdout + table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[2:]}
    assert "40/40" in rows["1"] and "does not answer" in rows["2"], table.stdout
    assert "instance 2 at" in table.stderr and "does not answer" in table.stderr

    assert as_json.returncode == 3, as_json.stderr
    status = json.loads(as_json.stdout)
    assert status["instances_detail"]["1"]["pool"]["num_blocks_free"] == 40
    assert list(status["instances_unreachable"]) == ["2"] and "does not answer" in status["instances_unreachable"]["2"]


# ---- drain and uncordon -----------------------------------------------------------------------
def test_drain_called_off_meanwhile_fails_at_once(tmp_path):
    """The leader answers not_draining after an `uncordon` from elsewhere: exit 1 now, no time-out."""
    with fake("gmanager", tmp_path, "called_off"):
        started = time.monotonic()
        result = infctl("drain", "2", "--timeout", "30", "--state-dir", str(tmp_path))
        elapsed = time.monotonic() - started
    assert result.returncode == 1, result.stderr
    assert "the drain of instance 2 was called off" in result.stderr and "stays cordoned" not in result.stderr
    assert elapsed < 15


def test_drain_and_uncordon_through_a_standby_say_it_does_not_lead(tmp_path):
    """leader.json naming a live gManager that answers 503 (a standby): exit 3, as with no leader."""
    with fake("gmanager", tmp_path, "standby"):
        drained = infctl("drain", "2", "--state-dir", str(tmp_path))
        uncordoned = infctl("uncordon", "2", "--state-dir", str(tmp_path))
    for result in (drained, uncordoned):
        assert result.returncode == 3, result.stderr
        assert "recorded as the leader in" in result.stderr and "does not lead" in result.stderr
        assert "is a standby" in result.stderr


# ---- up ---------------------------------------------------------------------------------------
def test_up_fails_at_once_when_an_instance_exits_at_start(tmp_path):
    started = time.monotonic()
    result = infctl("up", "--state-dir", str(tmp_path), "--instances", "1", "--pool-blocks", "8",
                    "--model", "/nonexistent/model.gguf", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "instance 1 exited with code 1 while starting" in result.stderr
    assert "no model at /nonexistent/model.gguf" in result.stderr  # the end of its log
    assert time.monotonic() - started < 60


def test_up_fails_when_the_gmanager_exits(tmp_path):
    """A perf model that cannot be read stops the gManager at once: `up` fails with its log and
    stops the instances it started."""
    state = tmp_path / "state"
    result = infctl("up", "--state-dir", str(state), "--instances", "1", "--pool-blocks", "8",
                    "--perf-model", str(tmp_path / "missing.json"), timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the gManager exited with code 2 while starting" in result.stderr
    assert "missing.json" in result.stderr and "cluster up" not in result.stdout
    assert processes_over(state) == []


# ---- down -------------------------------------------------------------------------------------
def test_down_signals_only_this_clusters_daemons(tmp_path):
    """A record left by a killed daemon whose pid now runs something else is skipped (and does not
    keep `up` out); the daemons of this folder are stopped, a stale record's too (a hung daemon);
    one of another folder is not."""
    state = tmp_path / "state"
    with sleeper() as reused, fake_program(tmp_path, "infinited", state) as instance, \
            fake_program(tmp_path, "infinited", state) as hung, \
            fake_program(tmp_path, "infinite-gmanager", state) as gmanager, \
            fake_program(tmp_path, "infinited", tmp_path / "elsewhere") as other_cluster:
        write_record(state, 1, reused.pid, updated_at=1000.0)
        write_record(state, 2, instance.pid)
        write_record(state, 3, hung.pid, updated_at=time.time() - 60)
        write_record(state, 4, other_cluster.pid)
        write_leader(state, gmanager.pid)
        assert sorted(ClusterClient(state).instances()) == [2, 4]  # stale records are left out

        result = infctl("down", "--state-dir", str(state))
        assert result.returncode == 0, result.stderr
        assert "stopped 3 daemon(s)" in result.stdout
        assert f"left pid {reused.pid} alone: instance 1's record names it" in result.stderr
        assert f"left pid {other_cluster.pid} alone: instance 4's record" in result.stderr
        for stopped in (instance, hung, gmanager):
            assert exit_status(stopped) == -signal.SIGTERM
        assert reused.poll() is None and other_cluster.poll() is None


def test_down_goes_on_past_a_signal_it_may_not_send(tmp_path, monkeypatch):
    """A daemon of another user: the others are still stopped; the refusal is exit 1."""
    state = tmp_path / "state"
    with fake_program(tmp_path, "infinited", state) as others, fake_program(tmp_path, "infinited", state) as ours:
        write_record(state, 1, others.pid)
        write_record(state, 2, ours.pid)
        send = os.kill

        def kill(pid: int, signum: int) -> None:
            if pid == others.pid and signum != 0:
                raise PermissionError(1, "Operation not permitted")
            send(pid, signum)

        monkeypatch.setattr(os, "kill", kill)
        result = CliRunner().invoke(app, ["down", "--state-dir", str(state)])
        monkeypatch.undo()
        assert result.exit_code == 1, result.output
        assert f"could not signal 1: instance 1 (pid {others.pid}): Operation not permitted" in result.output
        assert "stopped 1 daemon(s)" in result.output
        assert exit_status(ours) == -signal.SIGTERM and others.poll() is None


@pytest.mark.parametrize("argv, program", [
    (["/usr/bin/python3", "-m", "infinite_llm.daemon", "--instance-id", "1"], "infinited"),
    (["python", "-u", "-X", "dev", "-m", "infinite_llm.scheduler.gmanager"], "infinite-gmanager"),
    (["/usr/bin/python3", "/usr/local/bin/infinited", "--config", "x.toml"], "infinited"),
    (["/usr/bin/python3", "/usr/local/bin/infinite-gmanager", "--state-dir", "/s"], "infinite-gmanager"),
    (["python", "-c", "pass", "-m", "infinite_llm.daemon"], None),
    (["python", "other.py", "-m", "infinite_llm.daemon"], None),
    (["sleep", "300"], None),
])
def test_daemon_program_reads_how_up_and_the_entry_points_start_the_daemons(argv, program):
    assert daemon_program(argv)[0] == program
