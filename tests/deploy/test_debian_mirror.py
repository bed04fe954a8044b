"""test-deploy.sh's Debian mirror for debootstrap: exactly one URL from any apt source tree.

Runs the script itself (`deploy/podman/test-deploy.sh --debian-mirror`, under its own `set -euo pipefail`)
against sample /etc/apt trees. Its old grep | head pipeline gave debootstrap "URL\\nURL" when apt had no
sources.list (deb822 only, grep's exit 2) or more matches than head read (SIGPIPE), with pipefail on.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy/podman/test-deploy.sh"
FALLBACK = "http://deb.debian.org/debian"

ONE_LINE = """\
# deb http://commented.example/debian bookworm main
deb-src http://src.example/debian bookworm main
deb https://packages.cloud.google.com/apt cloud-sdk-bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://mirror.example/debian/ bookworm main
deb http://deb.debian.org/debian bookworm-updates main
deb http://security.debian.org/debian-security bookworm-security main
"""

DEB822 = """\
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm
Components: main
Enabled: no

Types: deb-src
URIs: http://src.example/debian
Suites: bookworm
Components: main

Types: deb
# http://snapshot.debian.org/archive/debian/20250520T000000Z
URIs: http://deb.debian.org/debian-security
Suites: bookworm-security
Components: main

Types: deb
URIs: http://snapshot.debian.org/archive/debian/20250520T000000Z
 https://ftp.example.org/pub/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
"""


def mirror(apt: Path, debian_mirror: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "DEBIAN_MIRROR"} | {"APT_DIR": str(apt)}
    if debian_mirror is not None:
        env["DEBIAN_MIRROR"] = debian_mirror
    return subprocess.run([str(SCRIPT), "--debian-mirror"], check=False, env=env, capture_output=True, text=True,
                          timeout=30)  # fmt: skip


def tree(root: Path, files: dict[str, str]) -> Path:
    (root / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (root / name).write_text(text)
    return root


@pytest.mark.parametrize(
    "files, url",
    [
        # one-line format, several sources: comments, deb-src and a third-party repository skipped, options read
        ({"sources.list": ONE_LINE}, "http://mirror.example/debian"),
        # many matching lines after the first (the old pipeline's SIGPIPE), in sources.list.d/*.list
        ({"sources.list.d/a.list": "deb http://first.example/debian bookworm main\n" * 1,
          "sources.list.d/b.list": "deb http://deb.debian.org/debian bookworm main\n" * 5000}, "http://first.example/debian"),
        # deb822 only, no sources.list (this machine's kind): disabled, deb-src, security, snapshot skipped
        ({"sources.list.d/debian.sources": DEB822}, "https://ftp.example.org/pub/debian"),
        # sources.list first, then sources.list.d in name order; files apt ignores are not read
        ({"sources.list": "deb https://packages.cloud.google.com/apt x main\n",
          "sources.list.d/a.list.disabled-by-farm": "deb http://disabled.example/debian bookworm main\n",
          "sources.list.d/b.sources": DEB822, "sources.list.d/c.list": "deb http://later.example/debian b main\n"},
         "https://ftp.example.org/pub/debian"),
        # no Debian source at all -> the fallback
        ({}, FALLBACK),
        ({"sources.list.d/nodesource.sources": "Types: deb\nURIs: https://deb.nodesource.com/node_20.x\n",
          "sources.list.d/debian.sources.disabled": DEB822}, FALLBACK),
    ],
    ids=["one-line", "sigpipe", "deb822", "order", "none", "no-debian"],
)  # fmt: skip
def test_exactly_one_url(tmp_path, files, url):
    r = mirror(tree(tmp_path / "apt", files))
    assert (r.returncode, r.stdout, r.stderr) == (0, url + "\n", "")


def test_no_apt_directory(tmp_path):
    r = mirror(tmp_path / "missing")
    assert (r.returncode, r.stdout) == (0, FALLBACK + "\n")


def test_debian_mirror_overrides(tmp_path):
    r = mirror(tree(tmp_path / "apt", {"sources.list": ONE_LINE}), "http://override.example/debian")
    assert (r.returncode, r.stdout) == (0, "http://override.example/debian\n")


def test_not_one_url_fails_in_one_line(tmp_path):
    r = mirror(tree(tmp_path / "apt", {}), "http://a.example/debian\nhttp://a.example/debian")
    assert r.returncode == 1 and r.stdout == ""
    line = "test-deploy: FAILED: the Debian mirror is not one URL: 'http://a.example/debian\\nhttp://a.example/debian'"
    assert r.stderr.splitlines() == [line]
