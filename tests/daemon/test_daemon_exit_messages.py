"""How ``infinited`` ends when start-up fails: one ``infinited: ...`` line naming the cause and a
non-zero exit, never a traceback or an empty message. A real process where the failure is
real (a pool that does not fit in memory); a stand-in daemon for the other failures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinite_llm.daemon import main as daemon_main
from infinite_llm.daemon.instance import StartupError


def test_a_pool_that_does_not_fit_in_memory_ends_in_one_line_naming_its_size(tmp_path: Path) -> None:
    """The value is valid; the allocation fails only once the model has loaded."""
    result = subprocess.run(
        [sys.executable, "-m", "infinite_llm.daemon", "--kv-pool-blocks", "1000000000", "--http-port", "0",
         "--socket-path", str(tmp_path / "s.sock"), "--state-dir", str(tmp_path / "state")],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("infinited: out of memory building the engine on cpu with a KV pool of 1000000000 "
                           "blocks (kv_pool_blocks): "), last
    assert last.endswith("give a smaller kv_pool_blocks or kv_pool_bytes"), last


def _daemon_failing_with(error: BaseException, engine_built: bool = False):
    class FailingDaemon:
        """Stands in for InstanceDaemon: start-up fails with ``error``."""

        def __init__(self, config, gmanager_token=None) -> None:
            self.engine = object() if engine_built else None

        async def run(self) -> None:
            raise error

    return FailingDaemon


@pytest.mark.parametrize(("args", "error", "line"), [
    (["--kv-pool-bytes", "200000000000"], torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 186.26 GiB.\n"
                                                                 "GPU 0 has a total capacity of 139.81 GiB"),
     "infinited: out of memory building the engine on cpu with a KV pool of 200000000000 bytes (kv_pool_bytes): "
     "CUDA out of memory. Tried to allocate 186.26 GiB.; give a smaller kv_pool_blocks or kv_pool_bytes"),
    ([], StartupError("instance 1 could not register within 0.3 s (three etcd request timeouts)"),
     "infinited: instance 1 could not register within 0.3 s (three etcd request timeouts)"),
    ([], TimeoutError(), "infinited: TimeoutError"),  # an error without text is named by its type
    ([], ConnectionResetError("\n"), "infinited: ConnectionResetError"),
    ([], ValueError("first line\nsecond line"), "infinited: first line"),
])
def test_a_failed_start_is_one_line_and_a_non_zero_exit(monkeypatch, capsys, tmp_path: Path, args, error, line) -> None:
    monkeypatch.setattr(daemon_main, "InstanceDaemon", _daemon_failing_with(error))
    assert daemon_main.main([*args, "--state-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == line + "\n"


def test_a_memory_error_of_a_running_engine_is_not_blamed_on_the_pool(monkeypatch, tmp_path: Path) -> None:
    """The pool was allocated: an allocation that fails later is a fault, left with its traceback."""
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(daemon_main, "InstanceDaemon", _daemon_failing_with(error, engine_built=True))
    with pytest.raises(torch.OutOfMemoryError):
        daemon_main.main(["--state-dir", str(tmp_path)])
    other = RuntimeError("a fault of the code")
    monkeypatch.setattr(daemon_main, "InstanceDaemon", _daemon_failing_with(other))
    with pytest.raises(RuntimeError, match="a fault of the code"):
        daemon_main.main(["--state-dir", str(tmp_path)])
