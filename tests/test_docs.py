"""What the README and docs/ promise, checked against the tree: the README is a front door that links every
page of docs/; every relative link (and its #anchor) in README.md, docs/*.md and deploy/README.md leads to a
file and a heading that exist; the commands the pages name exist (`make` targets, `pdserve` commands, every
`pdserve bench NAME` documented with a section and every documented one runnable, the admin CLI's
commands, the environment variables of the configuration table read by the code); and the README's
five-minute tour runs as written against a real gateway and node on the real model.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS, ROOT / "deploy" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)


def text(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def prose(page: Path) -> str:
    """The page without its code blocks (a link inside a code block is not a link)."""
    return FENCE.sub("", text(page))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation but '-' and '_' dropped, spaces as '-'."""
    out = set()
    for line in prose(page).splitlines():
        if m := re.match(r"^#{1,6}\s+(.*?)\s*#*$", line):
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def code(page: Path) -> str:
    return "\n".join(m.group(0) for m in FENCE.finditer(text(page)))


def test_docs_exist_and_the_readme_is_a_front_door():
    assert len(DOCS) >= 8, "docs/ holds the pages the README points to"
    lines = text(README).count("\n")
    assert lines <= 200, f"README.md is {lines} lines: a front door of ~150, the rest in docs/"
    linked = {(README.parent / t.split("#")[0]).resolve() for t in LINK.findall(prose(README))}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_make_targets_named_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", text(ROOT / "Makefile"), re.MULTILINE))
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"`make ([a-z][\w-]*)", text(page)))
        named |= set(re.findall(r"^make ([a-z][\w-]*)", code(page), re.MULTILINE))
    assert {"demo", "test", "stop"} <= named
    assert named <= targets, f"make targets named in the docs but not in the Makefile: {named - targets}"


def test_pdserve_commands_named_exist():
    from autoscaler.cli import BENCHES, COMMANDS

    named = set()
    for page in PAGES:
        named |= set(re.findall(r"(?:`|^|bin/)pdserve (?!bench)([a-z][a-z-]*)", text(page), re.MULTILINE))
    assert named <= set(COMMANDS), f"`pdserve CMD` named in the docs but not a command: {named - set(COMMANDS)}"
    benches = set()
    for page in PAGES:
        benches |= set(re.findall(r"pdserve bench ([a-z][a-z-]*)", text(page)))
    assert benches <= set(BENCHES), f"`pdserve bench` names that do not exist: {benches - set(BENCHES)}"
    heading = re.compile(r"^## .*\(`pdserve bench ([a-z-]+)`\)", re.MULTILINE)
    sections = set(heading.findall(text(ROOT / "docs" / "benchmarks.md")))
    assert set(BENCHES) <= sections, f"benchmarks with no section in docs/benchmarks.md: {set(BENCHES) - sections}"


def test_the_architecture_map_names_every_room_module_and_benchmark():
    """docs/architecture.md is the map: every module of compute's and gateway's rooms (tests/layers.py
    ``ROOMS``) and every `pdserve bench NAME` is on it, so a module or benchmark added is a line added there."""
    from autoscaler.cli import BENCHES
    from tests.layers import ROOMS

    page = text(ROOT / "docs" / "architecture.md")
    named = set(re.findall(r"`([a-z_0-9/]+\.py|[a-z_0-9]+/)`", page))
    missing = []
    for pkg, rooms in ROOMS.items():
        for room in rooms:
            folder = ROOT / pkg / room
            if not folder.is_dir():
                missing += [] if f"{pkg}/{room}.py" in named else [f"{pkg}/{room}.py"]
                continue
            for p in sorted(folder.glob("*.py")):
                if p.name != "__init__.py" and p.name not in named and f"{pkg}/{room}/{p.name}" not in named:
                    missing.append(f"{pkg}/{room}/{p.name}")
            missing += [f"{pkg}/{room}/{d.name}/" for d in folder.iterdir()
                        if d.is_dir() and (d / "__init__.py").exists() and f"{d.name}/" not in named]  # fmt: skip
    assert not missing, f"modules not on docs/architecture.md's map: {missing}"
    rows = set(re.findall(r"^\| `([a-z-]+)` \|", page, re.MULTILINE))
    assert set(BENCHES) <= rows, f"benchmarks not on the map: {set(BENCHES) - rows}"


def test_paramstore_commands_named_exist():
    from paramstore.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    named = set()
    for page in PAGES:
        named |= set(re.findall(r"(?:`|^|bin/)paramstore (?:-q )?([a-z][a-z-]*[a-z])\b", text(page), re.MULTILINE))
    commands = set(sub.choices)
    assert named <= commands, f"`paramstore CMD` named in the docs but not a command: {named - commands}"
    usage = re.compile(r"^paramstore \[--store.*?^```", re.DOTALL | re.MULTILINE)  # the Admin CLI block
    listed = set(re.findall(r"(?:^  |\| )([a-z][a-z-]*[a-z])\b", usage.search(text(ROOT / "docs" / "paramstore.md")).group(0),
                            re.MULTILINE))  # fmt: skip
    assert commands <= listed, f"admin CLI commands missing from docs/paramstore.md: {commands - listed}"


def test_configuration_env_vars_are_read_by_the_code():
    table = re.findall(r"^\| `([A-Z_]+)`", text(ROOT / "docs" / "configuration.md"), re.MULTILINE)
    assert "PDSERVE_CONFIG" in table and "PDSERVE_INTERNAL_TOKEN" in table
    source = "\n".join(p.read_text() for pkg in ("paramstore", "compute", "gateway", "autoscaler")
                       for p in (ROOT / pkg).rglob("*.py"))  # fmt: skip
    unread = [v for v in table if v not in source and not v.startswith("AWS_")]  # AWS_*: read by s3fs itself
    assert not unread, f"environment variables documented but never named in the code: {unread}"


def tour_python() -> str:
    block = re.search(r"^```python\n(.*?)^```", text(README), re.DOTALL | re.MULTILINE)
    assert block, "the README's tour has an `openai` client example"
    return block.group(1)


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, real_model_store):
    """The tour as written: its Python against a gateway over a real node, then `pdserve status` and
    `paramstore show`, each pointed at the test's service and store instead of `make demo`'s."""
    pytest.importorskip("openai")
    from tests.services import running_service

    locations, name = real_model_store
    assert name == "smollm2"
    with running_service(tmp_path, locations, name, ["both"]) as svc:
        url = svc["gw"].url
        script = tour_python().replace("http://127.0.0.1:8000", url)
        assert script != tour_python(), "the tour names the demo's URL"
        r = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "['smollm2']" in r.stdout and len(r.stdout.strip()) > len("['smollm2']"), r.stdout

        key = svc["gw"].admin_headers["Authorization"].removeprefix("Bearer ")
        env = {**os.environ, "PDSERVE_ADMIN_KEY": key}
        r = subprocess.run([sys.executable, "-m", "autoscaler.cli", "status", "--url", url], env=env,
                           check=False, capture_output=True, text=True, timeout=60)  # fmt: skip
        assert r.returncode == 0 and "smollm2" in r.stdout, r.stdout + r.stderr

    store = [a for loc in locations for a in ("--store", loc)]
    for cmd in re.findall(r"^\.venv/bin/paramstore (.*?)(?:\s+#.*)?$", text(README), re.MULTILINE):
        r = subprocess.run([sys.executable, "-m", "paramstore.cli", *store, *cmd.split()],
                           check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip(), f"paramstore {cmd}: {r.stdout}{r.stderr}"
