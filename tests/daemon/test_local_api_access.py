"""Who may do what on a live daemon's local API (the Unix socket).

One daemon for the file, told its admin group (``--admin-group``): a real group made here with
groupadd, and a real user in it made with useradd. Callers are forked children that take on
another identity (setgroups/setgid/setuid, as a login or a unit's User=/SupplementaryGroups=
would), so that the daemon reads them from SO_PEERCRED and SO_PEERGROUPS. Needs root. Every
wait is bounded.
"""

from __future__ import annotations

import errno
import grp
import json
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import uuid
from pathlib import Path

import pytest

from infinite_llm.daemon.http_api import LocalApp
from infinite_llm.daemon.local_cluster import LocalCluster, UnixHTTPConnection

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: it makes a group and a user, and calls as others")

OUTSIDER = 54321  # uid and gid in neither the socket's owner nor its group
CHILD_TIMEOUT_S = 120.0
PROMPT_BODY = {"prompt": "The capital of France is", "params": {"temperature": 0, "max_tokens": 4, "ignore_eos": True}}

# The routes of the local API, read from the app itself: every one but GET (and its HEAD) may
# change the instance.
_ROUTES = sorted({(route.method, route.resource.canonical)
                  for route in LocalApp(service=None, admin_gid=None).build().router.routes()})
MUTATING = [(method, path) for method, path in _ROUTES if method not in ("GET", "HEAD")]
READING = [(method, path) for method, path in _ROUTES if method == "GET"]


def test_the_routes_are_read_from_the_app():
    assert {("POST", "/v1/drain"), ("POST", "/v1/uncordon"), ("POST", "/v1/generate")} <= set(MUTATING)
    assert READING == [("GET", "/v1/status")]


@pytest.fixture(scope="module")
def admin_group():
    """A real group, and a real user whose supplementary groups (in the group database) hold it."""
    suffix = uuid.uuid4().hex[:8]
    group, user = f"infllm-adm-{suffix}", f"infllm-op-{suffix}"
    subprocess.run(["groupadd", group], check=True, timeout=30)
    try:
        subprocess.run(["useradd", "-M", "-N", "-s", "/usr/sbin/nologin", "-G", group, user], check=True, timeout=30)
        try:
            yield grp.getgrnam(group).gr_gid, group, user
        finally:
            subprocess.run(["userdel", user], check=False, timeout=30)
    finally:
        subprocess.run(["groupdel", group], check=False, timeout=30)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, admin_group):
    _, group, _ = admin_group
    cluster = LocalCluster(tmp_path_factory.mktemp("local-api"), num_instances=1, pool_blocks=64,
                           extra_args=["--admin-group", group])
    try:
        cluster.wait_ready()
        yield cluster[1]
    finally:
        cluster.stop()


@pytest.fixture
def reachable_by_anyone(daemon):
    """The socket opened to every user (0666) for one test, so that a caller outside the admin
    group gets as far as the daemon, which must then refuse its mutations itself."""
    os.chmod(daemon.socket_path, 0o666)
    try:
        yield
    finally:
        os.chmod(daemon.socket_path, 0o660)


def call_as(socket_path: Path, calls: list[tuple[str, str, object]], uid: int | None = None, gid: int | None = None,
            groups: list[int] | None = None, user: str | None = None) -> list[dict]:
    """Each call (method, path, body: None, bytes, or an object sent as JSON) made on the socket
    by a forked child that runs as ``uid``/``gid`` with supplementary ``groups``, or as ``user``
    with that user's groups from the group database (``initgroups``, as a login does). Each
    result: ``{"status", "body"}`` (NDJSON bodies as a list), or ``{"errno"}`` where the call could
    not connect."""
    if user is not None:
        entry = pwd.getpwnam(user)
        uid, gid = entry.pw_uid, entry.pw_gid
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: take the identity, call, report, exit without running any test code
        code = 1
        try:
            os.close(read_end)
            if user is not None:
                os.initgroups(user, gid)
            else:
                os.setgroups(groups or [])
            os.setgid(gid)
            os.setuid(uid)
            results = []
            for method, path, body in calls:
                data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
                conn = UnixHTTPConnection(str(socket_path), timeout=60)
                try:
                    conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
                    response = conn.getresponse()
                    raw = response.read()
                except OSError as exc:
                    results.append({"errno": exc.errno, "error": type(exc).__name__})
                    continue
                finally:
                    conn.close()
                if response.getheader("Content-Type", "").startswith("application/x-ndjson"):
                    parsed = [json.loads(line) for line in raw.splitlines() if line]
                else:
                    try:
                        parsed = json.loads(raw)
                    except ValueError:
                        parsed = raw.decode(errors="replace")
                results.append({"status": response.status, "body": parsed})
            os.write(write_end, json.dumps(results).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    try:
        with os.fdopen(read_end, "rb") as pipe:
            while True:
                ready, _, _ = select.select([pipe], [], [], CHILD_TIMEOUT_S)
                if not ready:
                    raise TimeoutError(f"the child calling as uid {uid} did not finish within {CHILD_TIMEOUT_S} s")
                chunk = os.read(pipe.fileno(), 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)  # gone already, unless it hung
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
    assert chunks, f"the child calling as uid {uid} failed (wait status {status})"
    return json.loads(b"".join(chunks))


def body_for(method: str, path: str) -> object:
    """A well-formed body for a route (so that a refusal is about the caller, not the body)."""
    return PROMPT_BODY if path == "/v1/generate" else {}


def tokens_of(lines: list[dict]) -> list[int]:
    return [t for line in lines for t in line["token_ids"]]


# --- (c) the socket's own mode keeps strangers out before the daemon sees them ---


def test_the_socket_is_mode_0660_owned_by_root_and_the_admin_group(daemon, admin_group):
    gid, _, _ = admin_group
    info = os.stat(daemon.socket_path)
    assert stat.S_ISSOCK(info.st_mode)
    assert stat.S_IMODE(info.st_mode) == 0o660
    assert (info.st_uid, info.st_gid) == (0, gid)


@pytest.mark.parametrize("groups", [[], [OUTSIDER + 1]], ids=["no-groups", "another-group"])
def test_a_caller_outside_owner_and_group_cannot_connect(daemon, groups):
    results = call_as(daemon.socket_path, [("GET", "/v1/status", None), *[(m, p, body_for(m, p)) for m, p in MUTATING]],
                      uid=OUTSIDER, gid=OUTSIDER, groups=groups)
    assert results == [{"errno": errno.EACCES, "error": "PermissionError"}] * (1 + len(MUTATING))
    assert daemon.status()["draining"] is False


# --- (a) past the socket's mode, a caller outside the admin group may read, not change ---


@pytest.mark.parametrize("groups", [[], [OUTSIDER + 1]], ids=["no-groups", "another-group"])
def test_a_caller_outside_the_admin_group_reads_but_may_not_mutate(daemon, reachable_by_anyone, groups):
    code, _ = daemon.local("POST", "/v1/drain")  # as root: so that a refused uncordon shows
    assert code == 200 and daemon.status()["draining"] is True
    try:
        calls = [(m, p, None) for m, p in READING] + [(m, p, body_for(m, p)) for m, p in MUTATING]
        results = call_as(daemon.socket_path, calls, uid=OUTSIDER, gid=OUTSIDER, groups=groups)
        reads, mutations = results[:len(READING)], results[len(READING):]
        assert [r["status"] for r in reads] == [200] * len(READING)
        assert reads[0]["body"]["instance_id"] == 1 and reads[0]["body"]["draining"] is True
        for (method, path), result in zip(MUTATING, mutations):
            assert result["status"] == 403, (method, path, result)
            assert f"uid {OUTSIDER}" in result["body"]["error"] and "admin group" in result["body"]["error"], result
        # Malformed bodies are refused for who sends them, before they are read.
        result, = call_as(daemon.socket_path, [("POST", "/v1/generate", b"{not json")], uid=OUTSIDER, gid=OUTSIDER,
                          groups=groups)
        assert result["status"] == 403
        # Nothing changed: still draining (the uncordon was refused), and nothing ran.
        status = daemon.status()
        assert status["draining"] is True and status["requests"] == []
    finally:
        code, _ = daemon.local("POST", "/v1/uncordon")
        assert code == 200
    assert daemon.status()["draining"] is False


# --- (b) a caller in the admin group may mutate ---


def test_a_member_by_supplementary_group_may_generate(daemon, admin_group):
    gid, _, _ = admin_group
    root_code, root_lines = daemon.local("POST", "/v1/generate", PROMPT_BODY, timeout=120)
    assert root_code == 200
    status, generate = call_as(daemon.socket_path, [("GET", "/v1/status", None), ("POST", "/v1/generate", PROMPT_BODY)],
                               uid=OUTSIDER + 2, gid=OUTSIDER + 2, groups=[gid])
    assert status["status"] == 200
    assert generate["status"] == 200, generate
    lines = generate["body"]
    assert lines[-1]["finished"] is True and lines[-1]["finish_reason"] == "length"
    assert tokens_of(lines) == tokens_of(root_lines) and len(tokens_of(lines)) == 4  # the same greedy tokens


def test_a_member_by_primary_group_may_drain_and_uncordon(daemon, admin_group):
    gid, _, _ = admin_group
    drain, during, uncordon = call_as(
        daemon.socket_path, [("POST", "/v1/drain", None), ("GET", "/v1/status", None), ("POST", "/v1/uncordon", None)],
        uid=OUTSIDER + 3, gid=gid, groups=[])
    assert drain["status"] == 200 and drain["body"]["draining"] is True and drain["body"]["safe_to_stop"] is True
    assert during["status"] == 200 and during["body"]["draining"] is True
    assert uncordon["status"] == 200 and uncordon["body"] == {"draining": False}
    assert daemon.status()["draining"] is False


def test_a_real_user_of_the_admin_group_may_generate(daemon, admin_group):
    """A user that the group database puts in the admin group, with the groups a login gives it."""
    gid, _, user = admin_group
    entry = pwd.getpwnam(user)
    assert entry.pw_gid != gid and gid in os.getgrouplist(user, entry.pw_gid)  # a supplementary member
    generate, malformed = call_as(daemon.socket_path, [("POST", "/v1/generate", PROMPT_BODY),
                                                       ("POST", "/v1/generate", {"prompt": 5})], user=user)
    assert generate["status"] == 200 and len(tokens_of(generate["body"])) == 4, generate
    assert malformed["status"] == 400 and "prompt" in malformed["body"]["error"]  # allowed in, then the body is judged


# --- (d) malformed bodies get 400 and say why ---

# Of the mutating routes only /v1/generate reads a body (drain and uncordon take none).
MALFORMED = [
    (b"{not json", "not valid JSON"),
    (b"", "not valid JSON"),
    (b"\xff\xfe", "not valid JSON"),
    (b'{"prompt": "x"} trailing', "not valid JSON"),
    (b"[" * 5000, "not valid JSON"),  # past the parser's depth limit
    (b'{"prompt": "\\ud800"}', "not valid JSON"),  # a lone surrogate
    (b'{"prompt": "x", "params": {"stop_token_ids": [1e400]}}', "not valid JSON"),
    (b"[]", "must be a JSON object"),
    (b'"prompt"', "must be a JSON object"),
    (b"5", "must be a JSON object"),
    (b"null", "must be a JSON object"),
    (b"{}", "exactly one of prompt and messages"),
    (b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}', "exactly one of prompt and messages"),
    (b'{"prompt": "x", "colour": "red"}', "unknown field: colour"),
    (b'{"prompt": 5}', "prompt must be"),
    (b'{"prompt": true}', "prompt must be"),
    (b'{"prompt": ""}', "prompt must be"),
    (b'{"prompt": []}', "prompt must be"),
    (b'{"prompt": {"text": "x"}}', "prompt must be"),
    (b'{"prompt": [1, "2"]}', "prompt must be"),
    (b'{"prompt": [true]}', "prompt must be"),
    (b'{"prompt": [-1]}', "prompt must be"),
    (b'{"prompt": [1.5]}', "prompt must be"),
    (b'{"prompt": [1000000000]}', "outside the vocabulary"),
    (b'{"prompt": [18446744073709551615]}', "outside the vocabulary"),
    (b'{"messages": "hi"}', "messages must be a non-empty list"),
    (b'{"messages": []}', "messages must be a non-empty list"),
    (b'{"messages": {"role": "user", "content": "x"}}', "messages must be a non-empty list"),
    (b'{"messages": [5]}', "messages[0].role"),
    (b'{"messages": [{"role": 5, "content": "x"}]}', "messages[0].role"),
    (b'{"messages": [{"role": "user"}]}', "messages[0].content"),
    (b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages[0].content"),
    (b'{"prompt": "x", "params": []}', "params must be an object"),
    (b'{"prompt": "x", "params": null}', "params must be an object"),
    (b'{"prompt": "x", "params": "greedy"}', "params must be an object"),
    (b'{"prompt": "x", "params": {"colour": 1}}', "unexpected keyword argument 'colour'"),
    (b'{"prompt": "x", "params": {"self": 1}}', "params:"),
    (b'{"prompt": "x", "params": {"max_tokens": "many"}}', "max_tokens"),
    (b'{"prompt": "x", "params": {"max_tokens": true}}', "max_tokens"),
    (b'{"prompt": "x", "params": {"max_tokens": 0}}', "max_tokens"),
    (b'{"prompt": "x", "params": {"max_tokens": 2.5}}', "max_tokens"),
    (b'{"prompt": "x", "params": {"temperature": "hot"}}', "temperature"),
    (b'{"prompt": "x", "params": {"temperature": -1}}', "temperature"),
    (b'{"prompt": "x", "params": {"top_p": 7}}', "top_p"),
    (b'{"prompt": "x", "params": {"top_k": 1.5}}', "top_k"),
    (b'{"prompt": "x", "params": {"seed": "s"}}', "seed"),
    (b'{"prompt": "x", "params": {"stop": 5}}', "stop"),
    (b'{"prompt": "x", "params": {"stop": [5]}}', "stop"),
    (b'{"prompt": "x", "params": {"stop": [""]}}', "stop"),
    (b'{"prompt": "x", "params": {"stop_token_ids": [-1]}}', "stop_token_ids"),
    (b'{"prompt": "x", "params": {"stop_token_ids": "7"}}', "stop_token_ids"),
]


def test_malformed_generate_bodies_get_400_with_a_message(daemon):
    for body, message in MALFORMED:
        code, answer = daemon.local("POST", "/v1/generate", body, timeout=60)
        assert code == 400, (body[:80], code, answer)
        assert isinstance(answer, dict) and isinstance(answer.get("error"), str), (body[:80], answer)
        assert message in answer["error"], (body[:80], answer)
    # Nothing of that ran, and the daemon serves on.
    status = daemon.status()
    assert status["requests"] == [] and status["pool"]["num_blocks_free"] == 64
    code, lines = daemon.local("POST", "/v1/generate", PROMPT_BODY, timeout=120)
    assert code == 200 and len(tokens_of(lines)) == 4
    assert " ERROR " not in daemon.log_path.read_text()
