"""The Debian mirror debootstrap uses in test-deploy.sh: exactly one URL, printed on one line.

    python3 deploy/podman/debian_mirror.py [APT_DIR]      (default /etc/apt)

Read as apt reads its sources: ``sources.list``, then ``sources.list.d/*.list`` (one-line format) and
``sources.list.d/*.sources`` (deb822 stanzas) in name order; other names (``*.disabled``, backups) are not
sources. The first enabled ``deb`` source whose http(s) URI path ends in ``/debian`` wins (not
``debian-security``, not snapshot or third-party repositories); none -> http://deb.debian.org/debian.
Plain Python and stdlib only: runs with the system's python3, before any venv exists.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

FALLBACK = "http://deb.debian.org/debian"
ARCHIVE = re.compile(r"^https?://[^\s/]+(/[^\s]*)?/debian/?$")


def one_line_uris(text: str):
    """URIs of the `deb` lines of a sources.list file (`deb [options] URI suite [components]`)."""
    for line in text.splitlines():
        words = line.split("#", 1)[0].split()
        if not words or words[0] != "deb":
            continue
        words = words[1:]
        if words and words[0].startswith("["):  # options: [arch=amd64 signed-by=...], maybe with spaces
            while words and not words[0].endswith("]"):
                words = words[1:]
            words = words[1:]
        if words:
            yield words[0]


def deb822_uris(text: str):
    """URIs of the enabled `Types: deb` stanzas of a .sources file (blank lines between stanzas)."""
    stanzas, fields, last = [], {}, None
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if fields:
                stanzas.append(fields)
            fields, last = {}, None
        elif line[0] in " \t" and last is not None:  # a continued field value
            fields[last] += " " + line.strip()
        elif ":" in line:
            last, value = line.split(":", 1)
            last = last.strip().lower()
            fields[last] = value.strip()
    for f in stanzas:
        if "deb" in f.get("types", "").split() and f.get("enabled", "yes").lower() != "no":
            yield from f.get("uris", "").split()


def debian_mirror(apt_dir: Path) -> str:
    lists = [apt_dir / "sources.list"] + sorted((apt_dir / "sources.list.d").glob("*"))
    for path in lists:
        if not path.is_file() or path.suffix not in (".list", ".sources"):
            continue
        text = path.read_text(errors="replace")
        for uri in deb822_uris(text) if path.suffix == ".sources" else one_line_uris(text):
            if ARCHIVE.match(uri):
                return uri.rstrip("/")
    return FALLBACK


if __name__ == "__main__":
    print(debian_mirror(Path(sys.argv[1] if len(sys.argv) > 1 else "/etc/apt")))
