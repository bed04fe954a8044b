"""The `pdserve` and `paramstore` commands run as the user runs them (subprocesses), without the developer's
pdserve environment variables; ``resolved``: what a command resolved (``--print-config``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

PDSERVE = [sys.executable, "-m", "autoscaler.cli"]
PARAMSTORE = [sys.executable, "-m", "paramstore.cli"]
_VARS = ("PDSERVE_CONFIG", "PARAMSTORE_CONFIG", "PDSERVE_CACHE_DIR", "PDSERVE_INTERNAL_TOKEN", "PDSERVE_API_KEYS",
         "PDSERVE_ADMIN_KEY", "PDSERVE_INTERNAL_TOKEN_FILE", "PDSERVE_API_KEYS_FILE", "PDSERVE_ADMIN_KEY_FILE",
         "PDSERVE_DEBUG", "PDSERVE_STEP")  # fmt: skip


def run(cmd: list[str], env: dict | None = None, timeout: float = 60, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in _VARS}
    return subprocess.run(cmd, env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def resolved(cmd: list[str], env: dict | None = None) -> dict:
    r = run(cmd + ["--print-config"], env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)
