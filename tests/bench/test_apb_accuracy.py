"""The APB accuracy benchmark on the CPU with the embedded model: the JSON it writes, and APB
decoding exactly what exact prefill decodes when its passing blocks drop nothing."""

from __future__ import annotations

import pytest

import json
import subprocess
import sys
from pathlib import Path

from infinite_llm.bench.apb_accuracy import Method, apb_config, chunk_bounds, summarize

BENCH = Path(__file__).resolve().parents[2] / "bench" / "apb_accuracy.py"
METHODS = ["exact", "apb-h2", "nopass-h2", "random-h2"]


def _run(out: Path, *args: str) -> dict:
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--lengths", "512", "--tasks", "passkey,multikey",
                    "--out", str(out), *args], check=True, timeout=240)
    return json.loads(out.read_text())


@pytest.mark.slow  # a whole run of the bench on the CPU: tens of seconds
def test_the_json_holds_every_method_task_and_length(tmp_path: Path) -> None:
    result = _run(tmp_path / "acc.json", "--samples", "2", "--methods", ",".join(METHODS))
    assert result["bench"] == "apb_accuracy" and result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["prompt_format"] == "raw" and result["model"].endswith(".gguf")
    assert (result["anchor_frac"], result["passing_frac"], result["seeds"]) == (0.25, 0.125, [0, 1])
    rows = {(r["method"], r["task"], r["length"]): r for r in result["results"]}
    assert set(rows) == {(m, t, 512) for m in METHODS for t in ("passkey", "multikey")}
    for (method, _, _), row in rows.items():
        assert 0.0 <= row["accuracy"] <= 1.0 and row["samples"] == 2 and row["wall_s"] > 0
        assert row["accuracy"] == row["correct"] / 2
        assert 480 <= row["mean_prompt_tokens"] <= 512
        assert (row["mean_passing_len"] == 0) == (method in ("exact", "nopass-h2"))
        assert (row["mean_anchor_len"] > 0) == (method != "exact")

    assert len(result["outputs"]) == 4  # 2 tasks x 2 samples
    for sample in result["outputs"]:
        assert 480 <= sample["prompt_tokens"] == sample["doc_tokens"] + sample["query_tokens"] <= 512
        assert set(sample["outputs"]) == set(METHODS)
        for output in sample["outputs"].values():
            assert output["correct"] == (sample["answer"] in output["text"])
    for (method, task, _), row in rows.items():
        assert row["correct"] == sum(s["outputs"][method]["correct"] for s in result["outputs"] if s["task"] == task)

    assert set(result["percent"]) == set(METHODS)
    percent = result["percent"]
    assert result["points_vs_exact"]["apb-h2"]["mean"] == percent["apb-h2"]["mean"] - percent["exact"]["mean"]
    assert set(result["verdict"]["h2"]) >= {"points_vs_exact", "within_goal_of_exact", "above_nopass", "above_random",
                                           "goal_met"}
    assert result["verdict"]["goal_met"] == result["verdict"]["h2"]["goal_met"]


def test_apb_that_drops_nothing_decodes_what_exact_decodes(tmp_path: Path) -> None:
    result = _run(tmp_path / "acc.json", "--samples", "1", "--methods", "exact,apb-h2,apb-h4",
                  "--passing-frac", "1", "--anchor-frac", "0")
    for sample in result["outputs"]:
        texts = {name: output["text"] for name, output in sample["outputs"].items()}
        assert texts["exact"] and texts["apb-h2"] == texts["exact"] and texts["apb-h4"] == texts["exact"], texts


def test_chunks_and_apb_lengths() -> None:
    assert chunk_bounds(10, 4) == [(0, 2), (2, 5), (5, 7), (7, 10)]
    config = apb_config(Method("apb-h4", "apb", 4), 10, anchor_frac=1.0, passing_frac=1.0, seed=3)
    # The anchor fits host 0's chunk; the passing block covers the longest chunk.
    assert (config.anchor_len, config.passing_len, config.scorer) == (2, 3, "attention")
    nopass = apb_config(Method("nopass-h2", "nopass", 2), 800, anchor_frac=0.25, passing_frac=0.125, seed=0)
    assert (nopass.anchor_len, nopass.passing_len) == (100, 0)
    random = apb_config(Method("random-h2", "random", 2), 800, anchor_frac=0.25, passing_frac=0.125, seed=7)
    assert (random.passing_len, random.scorer, random.seed) == (50, "random", 7)


def test_the_verdict_wants_apb_near_exact_and_above_both_ablations() -> None:
    methods = [Method("exact", "exact", 1), Method("apb-h2", "apb", 2), Method("nopass-h2", "nopass", 2),
               Method("random-h2", "random", 2)]

    def verdict(accuracies: dict[str, float]) -> dict:
        rows = [{"method": m, "task": "passkey", "length": 512, "accuracy": a} for m, a in accuracies.items()]
        return summarize(rows, methods).verdict

    met = verdict({"exact": 0.9, "apb-h2": 0.89, "nopass-h2": 0.5, "random-h2": 0.6})
    assert met["h2"]["within_goal_of_exact"] and met["goal_met"] is True
    assert verdict({"exact": 0.9, "apb-h2": 0.85, "nopass-h2": 0.5, "random-h2": 0.6})["goal_met"] is False
    assert verdict({"exact": 0.9, "apb-h2": 0.9, "nopass-h2": 0.9, "random-h2": 0.6})["goal_met"] is False


@pytest.mark.slow  # a whole run of the bench on the CPU: tens of seconds
def test_runs_split_by_task_merge_into_one_table(tmp_path: Path) -> None:
    parts = []
    for task in ("passkey", "multikey"):
        out = tmp_path / f"{task}.json"
        subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--lengths", "512", "--tasks", task,
                        "--samples", "1", "--methods", "exact,apb-h2", "--out", str(out)], check=True, timeout=240)
        part = json.loads(out.read_text())
        assert part["complete"] is True and part["tasks"] == [task]
        parts.append(out)
    merged_path = tmp_path / "merged.json"
    subprocess.run([sys.executable, str(BENCH), "--merge", *map(str, parts), "--out", str(merged_path)], check=True,
                   timeout=60)
    merged = json.loads(merged_path.read_text())
    assert merged["complete"] is True and merged["tasks"] == ["passkey", "multikey"] and merged["lengths"] == [512]
    assert [(r["method"], r["task"]) for r in merged["results"]] == [
        ("exact", "passkey"), ("apb-h2", "passkey"), ("exact", "multikey"), ("apb-h2", "multikey")]
    assert [s["task"] for s in merged["outputs"]] == ["passkey", "multikey"]
    assert set(merged["percent"]["exact"]) == {"passkey@512", "multikey@512", "mean"}
    assert [p["file"] for p in merged["merged_from"]] == ["passkey.json", "multikey.json"]

    # Parts that differ in their settings, or cover one cell twice, are refused.
    other = json.loads(parts[1].read_text()) | {"new_tokens": 3}
    (tmp_path / "other.json").write_text(json.dumps(other))
    refused = subprocess.run([sys.executable, str(BENCH), "--merge", str(parts[0]), str(tmp_path / "other.json"),
                              "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "new_tokens" in refused.stderr
    twice = subprocess.run([sys.executable, str(BENCH), "--merge", str(parts[0]), str(parts[0]),
                            "--out", str(tmp_path / "x.json")], capture_output=True, text=True, timeout=60)
    assert twice.returncode != 0 and "same (task, length) with the same seeds" in twice.stderr

    # Parts that split one cell's samples by seed add up.
    later = tmp_path / "passkey-seed1.json"
    subprocess.run([sys.executable, str(BENCH), "--device", "cpu", "--lengths", "512", "--tasks", "passkey",
                    "--samples", "1", "--seed", "1", "--methods", "exact,apb-h2", "--out", str(later)], check=True,
                   timeout=240)
    subprocess.run([sys.executable, str(BENCH), "--merge", str(parts[0]), str(later), "--out", str(merged_path)],
                   check=True, timeout=60)
    by_seed = json.loads(merged_path.read_text())
    assert by_seed["seeds"] == [0, 1] and by_seed["samples_per_cell"] == {"passkey@512": 2}
    rows = {r["method"]: r for r in by_seed["results"]}
    first_part = {r["method"]: r for r in json.loads(parts[0].read_text())["results"]}
    second_part = {r["method"]: r for r in json.loads(later.read_text())["results"]}
    for method, row in rows.items():
        assert row["samples"] == 2 and row["correct"] == first_part[method]["correct"] + second_part[method]["correct"]
        assert row["accuracy"] == row["correct"] / 2
    assert [s["seed"] for s in by_seed["outputs"]] == [0, 1]
