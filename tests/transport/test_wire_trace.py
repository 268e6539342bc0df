"""The wire trace: off by default, on through INFLLM_WIRE_TRACE, written at exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RECORDING_PROCESS = """
from infinite_llm.transport import wire_trace
assert wire_trace.enabled()
wire_trace.record("req.encoded", "attend_request", 7)
wire_trace.record("req.posted", "attend_request", 7)
"""


SILENT_PROCESS = """
from infinite_llm.transport import wire_trace
assert not wire_trace.enabled()
wire_trace.record("in.header", "echo", 1)  # a no-op
assert wire_trace.write() is None
"""


def test_off_unless_the_environment_names_a_directory(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "INFLLM_WIRE_TRACE"}
    subprocess.run([sys.executable, "-c", SILENT_PROCESS], env=env, check=True, timeout=120, cwd=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_process_writes_its_events_in_order_at_exit(tmp_path: Path) -> None:
    env = {**os.environ, "INFLLM_WIRE_TRACE": str(tmp_path)}
    subprocess.run([sys.executable, "-c", RECORDING_PROCESS], env=env, check=True, timeout=120)
    [path] = tmp_path.glob("wire-*.jsonl")
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e[1:] for e in events] == [["req.encoded", "attend_request", 7], ["req.posted", "attend_request", 7]]
    assert events[0][0] <= events[1][0]  # perf_counter seconds
