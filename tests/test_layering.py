"""The packages import only downwards: paramstore < compute < gateway < autoscaler < benchmarks.

Every module's imports are read with `ast` (module level and function-local alike: a lazy import
is still a dependency; relative imports resolved), never by importing the module. A package may
import itself and the packages below it; the benchmarks (benchmarks/, outside the library) may
import every package, and no library package imports them. The CLI reaches the benchmarks only by
name, through autoscaler/cli.py's BENCHES table (importlib at run time): not an import.

Inside compute and gateway the same rule holds between their rooms (``ROOMS``, lowest first; a module
at the package's top is a room of its own): the engine sits below the node, routing below the API.

Also: every first-party module an import names exists (a move that left a stale import behind,
even one inside a function that only runs in a long benchmark, fails here), and every
`pdserve bench NAME` row points into benchmarks/ and starts (`--help`, run as the user runs it).
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

from tests.layers import LIBRARY, RANK, ROOMS

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIRST_PARTY = (*RANK, "tests")

# (file, package it may import against the rule): each one is a debt with a name, not a rule.
KNOWN_EXCEPTIONS: set[tuple[str, str]] = set()


def _modules(*packages: str) -> list[pathlib.Path]:
    return sorted(p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


def _name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import statement in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = _name(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # from .x import y / from .. import y
                base = package[: len(package) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            found.append((node.lineno, mod))
            # `from pkg import sub` may name a submodule: check it too where it is one
            found += [(node.lineno, f"{mod}.{a.name}") for a in node.names
                      if _resolves(f"{mod}.{a.name}")]  # fmt: skip
    return found


def _resolves(module: str) -> bool:
    p = ROOT.joinpath(*module.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def violations() -> tuple[list[str], set[tuple[str, str]]]:
    """Upward imports (file:line: module -> target), and which known exceptions were seen."""
    bad, seen = [], set()
    for path in _modules(*RANK):
        rel, top = path.relative_to(ROOT).as_posix(), path.relative_to(ROOT).parts[0]
        for line, mod in imports(path):
            target = mod.split(".")[0]
            if target in RANK and RANK[target] > RANK[top]:
                if (rel, target) in KNOWN_EXCEPTIONS:
                    seen.add((rel, target))
                else:
                    bad.append(f"{rel}:{line}: {_name(path)} imports {mod} ({top} is below {target})")
    return bad, seen


def room_violations() -> list[str]:
    """Imports between the rooms of one package that run up its ``ROOMS`` order (file:line: module -> target)."""
    root, bad = ROOT, []
    for pkg, rooms in ROOMS.items():
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if len(parts) < 2 or parts[1] == "__init__":
                continue
            room = parts[1]
            assert room in rooms, f"{path.relative_to(root)}: room {room!r} is not in ROOMS[{pkg!r}]"
            for line, mod in imports(path):
                target = mod.split(".")
                if target[0] == pkg and len(target) > 1 and target[1] in rooms:
                    if rooms.index(target[1]) > rooms.index(room):
                        bad.append(f"{path.relative_to(root).as_posix()}:{line}: {mod} ({room} is below {target[1]})")
    return bad


def test_packages_import_only_downwards():
    bad, _ = violations()
    assert not bad, "imports that run up the stack:\n" + "\n".join(bad)


def test_rooms_inside_a_package_import_only_downwards():
    bad = room_violations()
    assert not bad, "imports that run up a package's rooms:\n" + "\n".join(bad)


def test_the_room_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: the engine importing the node is reported, the node importing the engine is not."""
    for pkg in ROOMS:
        (tmp_path / pkg).mkdir()
    for room in ("engine", "node"):
        (tmp_path / "compute" / room).mkdir()
    (tmp_path / "compute" / "engine" / "x.py").write_text("def f():\n    from compute.node.y import g\n")
    (tmp_path / "compute" / "node" / "y.py").write_text("from compute.engine import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert room_violations() == ["compute/engine/x.py:2: compute.node.y (engine is below node)"]


def test_known_exceptions_are_still_needed():
    _, seen = violations()
    stale = KNOWN_EXCEPTIONS - seen
    assert not stale, f"no longer imported: remove from KNOWN_EXCEPTIONS: {sorted(stale)}"


def test_no_library_package_imports_benchmarks():
    bad = [f"{p.relative_to(ROOT)}:{line}: imports {mod}" for p in _modules(*LIBRARY)
           for line, mod in imports(p) if mod.split(".")[0] == "benchmarks"]  # fmt: skip
    assert not bad, "\n".join(bad)


def test_every_first_party_import_exists():
    missing = [f"{p.relative_to(ROOT)}:{line}: {mod}" for p in _modules(*FIRST_PARTY)
               for line, mod in imports(p)
               if mod.split(".")[0] in FIRST_PARTY and not _resolves(mod)]  # fmt: skip
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def test_the_rule_catches_an_upward_import(tmp_path, monkeypatch):
    """The check itself can fail: a paramstore module importing compute is reported."""
    (tmp_path / "paramstore").mkdir()
    (tmp_path / "paramstore" / "__init__.py").write_text("")
    (tmp_path / "paramstore" / "x.py").write_text("def f():\n    from compute.engine.engine import Engine\n")
    (tmp_path / "paramstore" / "y.py").write_text("from . import x\nfrom .x import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    bad, _ = violations()
    assert bad == ["paramstore/x.py:2: paramstore.x imports compute.engine.engine (paramstore is below compute)"]
    assert imports(tmp_path / "paramstore" / "y.py") == [(1, "paramstore"), (1, "paramstore.x"), (2, "paramstore.x")]


def _benches() -> dict:
    from autoscaler.cli import BENCHES

    return BENCHES


def test_every_bench_lives_in_benchmarks():
    assert _benches(), "pdserve bench has no benchmarks"
    for name, (module, _help) in _benches().items():
        assert module.startswith("benchmarks.") and _resolves(module), (name, module)


@pytest.mark.parametrize("name", sorted(_benches()))
def test_bench_starts(name):
    """`pdserve bench NAME --help` as the user runs it: the module imports and its arguments build."""
    r = subprocess.run([sys.executable, "-m", "autoscaler.cli", "bench", name, "--help"], cwd=ROOT, check=False,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"usage: pdserve bench {name}"), r.stdout
