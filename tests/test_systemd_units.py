"""The systemd units verify, score well in `systemd-analyze security`, and the example config loads."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from infinite_llm.daemon.config import load_config

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "systemd"
BIN = Path(sys.executable).parent

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")


@pytest.fixture
def unit_dir(tmp_path: Path) -> Path:
    """The units with their binaries pointed at this environment's, and instance 0 of each template."""
    for unit in UNITS.iterdir():
        if unit.suffix in (".service", ".socket", ".target"):
            text = unit.read_text().replace("/usr/local/bin/", f"{BIN}/")
            (tmp_path / unit.name).write_text(text)
            if "@." in unit.name:
                (tmp_path / unit.name.replace("@.", "@0.")).write_text(text)
    return tmp_path


def test_units_verify(unit_dir: Path) -> None:
    names = ["infinited@0.service", "infinited@0.socket", "infinite-gmanager.service", "infinite-llm.target"]
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=unit_dir,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "infinited@0" not in result.stderr, result.stderr  # no warning about the instance units


@pytest.mark.parametrize(("unit", "most"), [("infinited@0.service", 2.5), ("infinite-gmanager.service", 2.0)])
def test_hardening_scores(unit_dir: Path, unit: str, most: float) -> None:
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", unit], cwd=unit_dir,
                            capture_output=True, text=True, timeout=120)
    line = [l for l in result.stdout.splitlines() if "Overall exposure level" in l][-1]
    score = float(line.split(":")[1].split()[0])
    assert score <= most, line


def test_example_config_loads() -> None:
    config = load_config(UNITS / "etc" / "infinited.toml.example")
    assert config.timeouts.drain_s < 660  # under the unit's TimeoutStopSec
    assert config.admin_group == "infinite-llm-admin"


def test_the_instance_unit_gives_triton_a_persistent_writable_cache() -> None:
    """Under ProtectSystem=strict and ProtectHome, Triton's default cache (in the home) cannot be
    written: the unit points it into its own CacheDirectory."""
    text = (UNITS / "infinited@.service").read_text()
    assert "ProtectSystem=strict" in text and "CacheDirectory=infinite-llm" in text
    assert "Environment=TRITON_CACHE_DIR=/var/cache/infinite-llm/triton" in text
