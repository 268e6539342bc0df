"""A real gManager replica with --admin-token-file: its admin API over TCP takes only requests
that carry the token, its Unix socket needs none, and an instance's hand-over gets through with
the token and hears why without it."""

from __future__ import annotations

import asyncio
import http.client
import json
import os
from pathlib import Path

from gmanager_testlib import GManagerProcess

from infinite_llm.daemon.handover import LeaderAdmin, request_drain

TOKEN = "9f2c4e6a8b0d1f3e5a7c9b1d3f5e7a9c"


def write_token(path: Path, mode: int = 0o600) -> Path:
    path.write_text(TOKEN + "\n")
    os.chmod(path, mode)
    return path


def get_status_over_tcp(port: int, headers: dict[str, str]) -> tuple[int, dict, str | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/v1/status", headers=headers)
        response = conn.getresponse()
        return response.status, json.loads(response.read()), response.getheader("WWW-Authenticate")
    finally:
        conn.close()


def test_the_admin_api_over_tcp_takes_only_requests_that_carry_the_token(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    token_file = write_token(tmp_path / "admin-token")
    gmanager = GManagerProcess(state_dir, "gm", extra_args=["--admin-token-file", str(token_file)])
    try:
        status = gmanager.wait_leading()  # over the Unix socket: no token needed
        port = status["http_port"]
        code, body, challenge = get_status_over_tcp(port, {})
        assert (code, challenge) == (401, "Bearer") and "bearer token" in body["error"]
        code, body, _ = get_status_over_tcp(port, {"Authorization": f"Bearer {TOKEN[:-1]}0"})
        assert code == 401
        code, body, _ = get_status_over_tcp(port, {"Authorization": f"Bearer {TOKEN}"})
        assert code == 200 and body["leader"] is True and body["http_port"] == port

        leader = LeaderAdmin(status["leader_epoch"], "127.0.0.1", port, "")
        # Past the token check to the drain itself: no instance 9 has sent a heartbeat.
        with_token = asyncio.run(request_drain(leader, 9, 5.0, TOKEN))
        without = asyncio.run(request_drain(leader, 9, 5.0))
        assert with_token.outcome == "failed" and with_token.detail.startswith("404"), with_token
        assert without.outcome == "failed" and without.detail.startswith("401"), without
        assert "bearer token" in without.detail
    finally:
        assert gmanager.stop() == 0, gmanager.log()


def test_a_token_file_every_user_may_read_stops_the_gmanager_at_start(tmp_path):
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    token_file = write_token(tmp_path / "admin-token", mode=0o644)
    gmanager = GManagerProcess(state_dir, "gm", extra_args=["--admin-token-file", str(token_file)])
    try:
        assert gmanager.process.wait(timeout=60) == 2
    finally:
        gmanager.kill()
    assert f"--admin-token-file: admin token file {token_file}: readable or writable by every user" in gmanager.log()
