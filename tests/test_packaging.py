"""The folders install under the one namespace ``infinite_llm``, editable and as a wheel."""

import importlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = ["kernels", "engine", "transport", "scheduler", "daemon", "cli", "bench"]


@pytest.mark.parametrize("name", SUBPACKAGES)
def test_every_folder_imports_under_the_namespace(name: str) -> None:
    module = importlib.import_module(f"infinite_llm.{name}")
    assert Path(module.__file__).resolve().parent == REPO / name


def test_wheel_holds_only_the_namespace(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("infinite_llm-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"infinite_llm"}
    for name in SUBPACKAGES:
        assert f"infinite_llm/{name}/__init__.py" in names
    assert "infinite_llm/bench/results/perf_model-cpu.json" in names  # the local cluster's gManager plans with it


def test_wheel_install_imports(tmp_path: Path) -> None:
    """Install the wheel into a private target and import it from there, not from the checkout."""
    wheel_dir, target = tmp_path / "wheel", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheel_dir), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheel_dir.glob("infinite_llm-*.whl")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import infinite_llm.kernels as k, infinite_llm.engine as e; "
        "print(k.__file__); print(e.__file__)"
    )
    # -I: isolated mode, so neither the checkout nor the editable install's finder is on the path.
    out = subprocess.run(
        [sys.executable, "-I", "-c", code, str(target)], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert all(path.startswith(str(target)) for path in out), out
