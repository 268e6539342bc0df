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


def _syscalls_of(group: str, seen: set[str] | None = None) -> set[str]:
    """The system calls of one of systemd's filter groups (``@name``, nested groups expanded) or
    the one call ``group`` names, as this host's systemd defines them."""
    if not group.startswith("@"):
        return {group}
    seen = set() if seen is None else seen
    if group in seen:
        return set()
    seen.add(group)
    listing = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", group],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    calls: set[str] = set()
    for line in listing.splitlines()[1:]:
        name = line.strip()
        if name and not name.startswith("#"):
            calls |= _syscalls_of(name, seen)
    return calls


def _unit_filter(unit: str) -> set[str]:
    """The calls a unit's ``SystemCallFilter=`` lines allow: allow lists joined, ``~`` lists taken off."""
    allowed: set[str] = set()
    for line in (UNITS / unit).read_text().splitlines():
        if not line.startswith("SystemCallFilter="):
            continue
        value = line.split("=", 1)[1]
        names = set().union(*(_syscalls_of(n) for n in value.lstrip("~").split()))
        allowed = allowed - names if value.startswith("~") else allowed | names
    return allowed


@pytest.mark.parametrize("unit", ["infinited@.service", "infinite-gmanager.service"])
def test_the_daemons_load_and_compute_under_their_units_system_call_filter(unit: str) -> None:
    """The daemon's imports and a torch matmul on threads, under the unit's filter with the
    strictest action (the process is killed on a call outside it): torch and numpy set CPU
    affinity and memory policy as they load, which a filter without @resources kills."""
    import ctypes.util

    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("needs libseccomp")
    allowed = sorted(_unit_filter(unit))
    program = (
        "import ctypes, ctypes.util, sys\n"
        "lib = ctypes.CDLL(ctypes.util.find_library('seccomp'))\n"
        "lib.seccomp_init.restype = ctypes.c_void_p\n"
        "lib.seccomp_init.argtypes = [ctypes.c_uint32]\n"
        "lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]\n"
        "lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]\n"
        "lib.seccomp_load.argtypes = [ctypes.c_void_p]\n"
        "ctx = lib.seccomp_init(0x80000000)  # SCMP_ACT_KILL_PROCESS\n"
        f"for name in {allowed!r}:\n"
        "    number = lib.seccomp_syscall_resolve_name(name.encode())\n"
        "    if number >= 0:\n"
        "        lib.seccomp_rule_add(ctx, 0x7FFF0000, number, 0)  # SCMP_ACT_ALLOW\n"
        "assert lib.seccomp_load(ctx) == 0\n"
        "import numpy, torch\n"
        "import infinite_llm.daemon.main, infinite_llm.scheduler.gmanager\n"
        "torch.set_num_threads(2)\n"
        "x = torch.randn(256, 256)\n"
        "print(bool(torch.isfinite((x @ x).sum())), float(numpy.ones(4).sum()))\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"rc {result.returncode}: {result.stderr[-2000:]}"
    assert result.stdout.split() == ["True", "4.0"]
