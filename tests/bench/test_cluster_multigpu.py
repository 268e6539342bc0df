"""The cluster benchmark on the CPU: real daemons (and a gManager for the shared policy) serve
a small mixed trace. Static instances refuse the prompts longer than one pool; with KV shared
every request is served; the simulator's predictions and their errors are reported."""

from __future__ import annotations

import pytest

import json
import subprocess
import sys
from pathlib import Path

from infinite_llm.bench.cluster_multigpu import cluster_devices, result_suffix

BENCH = Path(__file__).resolve().parents[2] / "bench" / "cluster_multigpu.py"


@pytest.mark.slow  # a whole run of the bench on the CPU: tens of seconds
def test_shared_kv_serves_what_static_instances_refuse(tmp_path: Path) -> None:
    out = tmp_path / "cluster.json"
    # Pools of 48 blocks (768 tokens); one prompt in two is 800-1000 tokens.
    subprocess.run([sys.executable, str(BENCH), "--rates", "2", "--requests", "4", "--pool-blocks", "48",
                    "--short-tokens", "32,96", "--long-tokens", "800,1000", "--long-fraction", "0.5",
                    "--output-tokens", "4,6", "--max-num-batched-tokens", "256", "--out", str(out)],
                   check=True, timeout=600)
    report = json.loads(out.read_text())
    infinite, static = report["policies"]["infinite"]["2.0"], report["policies"]["static"]["2.0"]
    trace_long = [r for r in infinite["requests"] if r["prompt_tokens"] + r["output_tokens"] > 48 * 16]
    assert trace_long, "the trace has no request longer than one pool"
    assert infinite["measured"]["num_finished"] == 4 and infinite["measured"]["num_rejected"] == 0
    assert static["measured"]["num_rejected"] == len(trace_long)
    assert static["measured"]["num_finished"] == 4 - len(trace_long)
    for row in (infinite, static):
        done = [r for r in row["requests"] if r["error"] is None]
        assert all(r["tokens"] == r["output_tokens"] for r in done)
        assert row["predicted"]["num_finished"] == row["measured"]["num_finished"]
        assert row["error"]["throughput_tokens_per_s"]["predicted"] is not None
    # The long requests' KV spanned both instances: the home waited for its peer's part.
    assert report["remote_wait_per_layer_s"] > 0
    assert report["prefill_tokens_per_s"] > 0
    assert set(report["single_predicted_only"]) == {"2.0"}


def test_a_trace_the_cluster_cannot_hold_is_refused() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--pool-blocks", "48", "--long-tokens", "2000,3000"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "do not fit 2 pools" in proc.stderr


def test_instances_sharing_one_gpu_say_so_in_the_file_name() -> None:
    assert cluster_devices(True, 2, mps=True, gpu_count=4) == ["cuda:0", "cuda:0"]
    assert cluster_devices(True, 3, mps=False, gpu_count=2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert cluster_devices(False, 2, mps=False, gpu_count=0) == ["cpu", "cpu"]
    assert result_suffix("NVIDIA-H100-80GB-HBM3", 2, mps=True) == "NVIDIA-H100-80GB-HBM3-mps-x2"
    assert result_suffix("NVIDIA-H200", 2, mps=False) == "NVIDIA-H200-x2"
    assert result_suffix(None, 2, mps=False) == "cpu"


def test_mps_needs_a_gpu() -> None:
    proc = subprocess.run([sys.executable, str(BENCH), "--mps"], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "--mps needs --device cuda" in proc.stderr
