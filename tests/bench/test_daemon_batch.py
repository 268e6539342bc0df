"""The daemon benchmark's batch beside a split request (``bench/daemon.py --batch-beside-split``):
the step times read from streamed tokens, and one small run on the CPU (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm.bench.daemon import batch_steps, token_prompts

BENCH = Path(__file__).resolve().parents[2] / "bench" / "daemon.py"


def _stream(times: list[float]) -> list[tuple[float, dict]]:
    return [(t, {"token_ids": [7]}) for t in times]


def test_batch_steps_count_only_while_every_request_decodes() -> None:
    # The first request's first token at 0, the second's at 0.5: the window starts at 0.5 and
    # ends at the first of their last tokens (5); an event without tokens is not a step.
    first = _stream([0, 1, 2, 3, 4, 5]) + [(5.2, {"token_ids": []})]
    second = _stream([0.5, 1.5, 2.5, 3.5, 4.5, 5.5, 6.5])
    steps = batch_steps([first, second])
    assert steps["window"] == (0.5, 5)
    assert steps["step_s"] == pytest.approx(1.0) and steps["step_median_s"] == pytest.approx(1.0)
    assert steps["tokens_per_s"] == pytest.approx(2.0)
    assert steps["steps"] == 4  # the first request's tokens at 1..5, its first step from 1 to 2
    # Cut at the split request's last token.
    assert batch_steps([first, second], until=4.2)["window"] == (0.5, 4.2)
    with pytest.raises(RuntimeError, match="more --batch-new-tokens"):
        batch_steps([first, second], until=2.1)


def test_batch_prompts_are_distinct_and_repeatable() -> None:
    prompts = token_prompts(3, 16)
    assert prompts == token_prompts(3, 16) and len({tuple(p) for p in prompts}) == 3
    assert all(len(p) == 16 and all(1000 <= t < 30000 for t in p) for p in prompts)


@pytest.mark.slow  # two daemons on the CPU, a warm-up and a timed pair: about 40 s
def test_batch_beside_split_on_the_cpu(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(BENCH), "--context-items", "30", "--new-tokens", "48",
                    "--batch-beside-split", "2", "--batch-prompt-tokens", "64", "--batch-new-tokens", "10",
                    "--batch-repeats", "1", "--out-dir", str(tmp_path)], check=True, timeout=600)
    (out,) = tmp_path.glob("daemon-cpu-*-batch2.json")
    report = json.loads(out.read_text())
    assert report["splits"] == [] and report["moves"] == []
    case = report["batch_beside_split"]
    assert case["step_s_alone"] > 0 and case["step_s_beside_split"] > 0
    assert case["step_ratio"] == pytest.approx(case["step_s_beside_split"] / case["step_s_alone"])
    assert case["split_request_tokens_per_s"] > 0
    (beside,) = case["runs_beside_split"]
    # The batch stayed at home; the long request's KV was split over both instances.
    assert beside["batch_placements"] == [[1]] and beside["split_request_placement"] == [1, 2]
    assert beside["split_request_outlasted_batch"]
