"""The multi-GPU attention harness on the CPU: two real processes (gloo, UCX over TCP), every
method computes the same attention output as the others."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "distattention_multigpu.py"


def test_every_method_agrees_on_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--world", "2", "--contexts", "1024",
                    "--steps", "1", "--layers", "2", "--out", str(out)], check=True, timeout=240)
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert (row["parts"], row["context"]) == (2, 1024)
    methods = {"one_gpu", "head_parallel", "ring", "distattention_nccl", "distattention_ucx"}
    assert set(row["max_abs_diff"]) == methods
    assert all(diff < 1e-5 for diff in row["max_abs_diff"].values()), row["max_abs_diff"]
    assert all(row[f"{m}_us"] > 0 for m in methods)
    assert row["ratios"]["ring_over_distattention_ucx"] > 0


def test_bad_parts_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--world", "2", "--parts", "3"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--parts must be" in proc.stderr
