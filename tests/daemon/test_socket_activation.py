"""The local admin socket can come from systemd (socket activation), as infinited@.socket does."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from infinite_llm.daemon.local_cluster import UnixHTTPConnection

pytestmark = pytest.mark.skipif(shutil.which("systemd-socket-activate") is None,
                                reason="needs systemd-socket-activate (Debian's systemd)")


def test_daemon_serves_on_the_socket_systemd_passes(tmp_path: Path) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="infllm-act-"))
    passed = socket_dir / "activated.sock"
    own = socket_dir / "own.sock"
    env = dict(os.environ, UCX_TLS="tcp,sm,self", UCX_WARN_UNUSED_ENV_VARS="n", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    activator = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(passed), sys.executable, "-m", "infinite_llm.daemon",
         "--instance-id", "1", "--kv-pool-blocks", "16", "--http-port", "0", "--socket-path", str(own),
         "--state-dir", str(tmp_path / "state")],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        for _ in range(100):
            if passed.exists():
                break
            subprocess.run(["sleep", "0.1"])
        # The first connection starts the daemon; it answers once it has loaded the model.
        conn = UnixHTTPConnection(str(passed), timeout=180)
        conn.request("GET", "/v1/status")
        response = conn.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["instance_id"] == 1
        assert not own.exists()  # it served the passed socket and made none of its own
    finally:
        os.killpg(activator.pid, signal.SIGTERM)
        activator.wait(timeout=60)
        shutil.rmtree(socket_dir, ignore_errors=True)
