"""`infctl` against nothing (usage and unreachable errors) and against a real local cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from infinite_llm.cli.main import app
from infinite_llm.daemon.local_cluster import passkey_prompt

REPO = Path(__file__).resolve().parents[2]
PERF_MODEL = REPO / "bench" / "results" / "perf_model-cpu.json"


def infctl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "infinite_llm.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_usage_and_unreachable_exit_codes(tmp_path):
    runner = CliRunner()
    assert runner.invoke(app, ["drain"]).exit_code == 2  # missing INSTANCE
    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path)])
    assert result.exit_code == 3
    assert "no cluster runs" in result.output and "Traceback" not in result.output
    assert runner.invoke(app, ["rebalance", "--state-dir", str(tmp_path)]).exit_code == 3
    assert runner.invoke(app, ["drain", "7", "--state-dir", str(tmp_path)]).exit_code == 3


def test_bad_arguments_are_usage_errors_found_before_anything_is_asked(tmp_path):
    """Exit 2, one line, and nothing cordoned: a drain's timeout is checked before the drain."""
    runner = CliRunner()
    for args, said in ((["status", "--etcd", "localhost"], "host:port"),
                       (["status", "--etcd", "127.0.0.1:1", "--etcd-prefix", "noslash"], "etcd prefix must start"),
                       (["drain", "2", "--timeout", "-1"], "timeout must be"),
                       (["drain", "2", "--timeout", "nan"], "timeout must be"),
                       (["generate", "hi", "--timeout", "0"], "timeout must be"),
                       (["generate", "hi", "--timeout", "nan"], "timeout must be")):
        result = runner.invoke(app, [*args, "--state-dir", str(tmp_path)])
        assert result.exit_code == 2, (args, result.output)
        assert said in result.output and "Traceback" not in result.output and "ValueError" not in result.output


def test_an_answer_that_is_not_json_is_reported_with_its_status(tmp_path):
    """A daemon's unmapped failure is an HTTP 500 with a text body: one line naming the status
    and the text, not a JSON decoding error."""
    import socket

    from infinite_llm.cli.client import ClusterError, Endpoint

    path = tmp_path / "admin.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def answer_once() -> None:
        connection, _ = listener.accept()
        with connection:
            # The whole request first: http.client sends the body apart from the headers, and
            # closing before it came would fail the client's send (EPIPE), not its read.
            request = b""
            while not request.endswith(b'{"dry_run": false}'):
                chunk = connection.recv(65536)
                if not chunk:
                    return
                request += chunk
            body = b"500 Internal Server Error\n\nServer got itself in trouble"
            connection.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                               b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    server = threading.Thread(target=answer_once, daemon=True)
    server.start()
    with pytest.raises(ClusterError, match=r"HTTP 500 with no JSON: '500 Internal Server Error") as info:
        Endpoint("gManager (epoch 1)", os.getpid(), str(path)).call("POST", "/v1/rebalance", {"dry_run": False},
                                                                      timeout_s=10)
    assert info.value.exit_code == 1
    server.join(timeout=10)
    listener.close()


@pytest.fixture(scope="module")
def cluster_dir(tmp_path_factory):
    state = tmp_path_factory.mktemp("infctl")
    up = infctl("up", "--state-dir", str(state), "--instances", "2", "--pool-blocks", "40",
                "--perf-model", str(PERF_MODEL))
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        yield state
    finally:
        down = infctl("down", "--state-dir", str(state))
        assert down.returncode == 0, down.stderr


def test_status_generate_rebalance(cluster_dir):
    out = infctl("status", "--state-dir", str(cluster_dir), "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert sorted(status["instances_detail"]) == ["1", "2"]
    assert status["epoch"] >= 1

    gen = infctl("generate", "The capital of France is", "--state-dir", str(cluster_dir), "--max-tokens", "8")
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr

    plan = infctl("rebalance", "--dry-run", "--json", "--state-dir", str(cluster_dir))
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["dry_run"] is True

    one = infctl("status", "--instance", "1", "--state-dir", str(cluster_dir))
    assert one.returncode == 0 and "instance 1" in one.stdout


def test_drain_dry_run_and_unknown_instance(cluster_dir):
    # The leader is known from heartbeats within a period or two of start-up.
    for _ in range(50):
        plan = infctl("drain", "2", "--dry-run", "--json", "--state-dir", str(cluster_dir))
        if plan.returncode == 0:
            break
    assert plan.returncode == 0, plan.stderr
    report = json.loads(plan.stdout)
    assert report["dry_run"] is True and report["moves"] == [] and report["num_blocks_held"] == 0
    text = infctl("drain", "2", "--dry-run", "--state-dir", str(cluster_dir))
    assert text.returncode == 0 and "instance 2: 0 move(s) planned" in text.stdout, text.stderr
    unknown = infctl("drain", "9", "--state-dir", str(cluster_dir))
    assert unknown.returncode == 1 and "unknown instance 9" in unknown.stderr, unknown.stderr
    assert "Traceback" not in unknown.stderr
    status = json.loads(infctl("status", "--instance", "2", "--json", "--state-dir", str(cluster_dir)).stdout)
    assert status["draining"] is False  # a dry run changes nothing


def test_drain_waits_times_out_and_uncordons(cluster_dir):
    # A long request on instance 1: a drain with a short timeout must time out (exit 4). The
    # drain is answered about 1.5 s after the request shows in the status; 120 tokens decode
    # for about 10 s on two cores.
    done = threading.Event()

    def long_request() -> None:
        infctl("generate", passkey_prompt(30), "--instance", "1", "--max-tokens", "120", "--ignore-eos",
               "--state-dir", str(cluster_dir))
        done.set()

    thread = threading.Thread(target=long_request)
    thread.start()
    try:
        for _ in range(200):
            status = json.loads(infctl("status", "--instance", "1", "--json", "--state-dir", str(cluster_dir)).stdout)
            if status["requests"]:
                break
        timed_out = infctl("drain", "1", "--timeout", "0.5", "--state-dir", str(cluster_dir))
        assert timed_out.returncode == 4, timed_out.stdout + timed_out.stderr
        assert "still runs 1 request" in timed_out.stderr
    finally:
        thread.join(timeout=300)
    assert done.is_set()
    drained = infctl("drain", "1", "--timeout", "60", "--state-dir", str(cluster_dir))
    assert drained.returncode == 0 and "safe to stop" in drained.stdout
    refused = infctl("generate", "Hello", "--instance", "1", "--state-dir", str(cluster_dir))
    assert refused.returncode == 1 and "draining" in refused.stderr
    assert infctl("uncordon", "1", "--state-dir", str(cluster_dir)).returncode == 0
    assert infctl("generate", "Hello", "--instance", "1", "--max-tokens", "2", "--state-dir", str(cluster_dir)).returncode == 0
