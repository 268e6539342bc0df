"""The APB prefill benchmark on the CPU: two real processes over gloo; ring prefill matches
exact prefill, APB runs and reports its distance from exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "apb_prefill.py"


def test_ring_is_exact_and_apb_runs_on_two_processes(tmp_path: Path) -> None:
    out = tmp_path / "apb.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--world", "2", "--tokens", "256",
                    "--shape", "tiny", "--anchor", "32", "--passing", "16", "--out", str(out)], check=True, timeout=240)
    (row,) = json.loads(out.read_text())["rows"]
    assert (row["tokens"], row["hosts"], row["anchor_len"], row["passing_len"]) == (256, 2, 32, 16)
    assert row["last_row_vs_exact"]["ring"]["max_abs"] < 1e-5
    assert 0.0 < row["last_row_vs_exact"]["apb"]["cosine"] <= 1.0 + 1e-6
    assert row["exact_one_gpu_s"] > 0 and row["ring_s"] > 0 and row["apb_s"] > 0


def test_a_length_that_does_not_split_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--world", "2", "--tokens", "258",
                           "--shape", "tiny"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "multiple of 2 * hosts" in proc.stderr
