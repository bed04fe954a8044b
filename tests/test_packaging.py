"""The installed package is the tree: a wheel built from the tracked files holds every file the packages track
(a native source missing from it once left every container's node without its kernels, and CI's deploy test
without an answer)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("paramstore", "compute", "gateway", "autoscaler", "benchmarks")

pytestmark = pytest.mark.skipif(not os.path.isdir(os.path.join(ROOT, ".git")), reason="needs the git checkout")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", *PACKAGES], cwd=ROOT, capture_output=True, text=True, timeout=60,
                         check=True)  # fmt: skip
    return [p for p in out.stdout.splitlines() if os.path.exists(os.path.join(ROOT, p))]


def test_the_wheel_holds_every_tracked_file_of_the_packages(tmp_path):
    src = tmp_path / "src"
    for rel in _tracked() + ["pyproject.toml", "README.md"]:
        os.makedirs(src / os.path.dirname(rel), exist_ok=True)
        shutil.copy2(os.path.join(ROOT, rel), src / rel)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src),
                            "-w", str(tmp_path / "dist")], capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("pdserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in _tracked() if p not in names]
    assert not missing, f"tracked but not in the wheel (pyproject's package-data): {missing}"
