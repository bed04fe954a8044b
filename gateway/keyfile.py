"""The admin key `pdserve up` generates: written 0600 under its run directory, read by `pdserve status`.

Lifecycle: `pdserve up` with no $PDSERVE_ADMIN_KEY[_FILE] and no --open-admin generates a key (as it
generates the internal token), ``write``s <run dir>/keys/admin-<port>.key (the folder 0700, the file
0600, written whole and renamed into place) and ``remove``s it when it stops. `pdserve status` takes
$PDSERVE_ADMIN_KEY[_FILE], else ``read``s that file for the gateway's port, and only for a gateway on this
host's loopback (the file says nothing of another host's gateway on the same port: its key is never sent
there). The run directory:
$PDSERVE_RUN_DIR, else .pdserve in the working directory (where `make demo` keeps its pid and logs).
"""

from __future__ import annotations

import contextlib
import os
from urllib.parse import urlsplit

from compute.node.auth import LOOPBACK


def run_dir() -> str:
    return os.environ.get("PDSERVE_RUN_DIR") or ".pdserve"


def path(port: int | str) -> str:
    return os.path.join(run_dir(), "keys", f"admin-{port}.key")


def write(port: int, key: str) -> str:
    """Write the key for the gateway on `port`; readable by this user only. Returns the path."""
    where = path(port)
    os.makedirs(os.path.dirname(where), mode=0o700, exist_ok=True)
    os.chmod(os.path.dirname(where), 0o700)
    tmp = f"{where}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # (a leftover of a killed run with this pid)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)  # never through a planted link
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    os.replace(tmp, where)
    return where


def read(url: str) -> str | None:
    """The key `pdserve up` wrote for the gateway at `url`, if this run directory holds one and `url` is on
    this host's loopback."""
    try:
        u = urlsplit(url)
        if (u.hostname or "").lower() not in LOOPBACK:
            return None
        port = u.port or 80
        with open(path(port)) as f:
            return f.read().strip() or None
    except (OSError, ValueError):
        return None


def remove(port: int, key: str) -> None:
    """Remove the key file if it still holds `key` (a later `pdserve up` on the port may have replaced it)."""
    try:
        with open(path(port)) as f:
            if f.read().strip() == key:
                os.unlink(path(port))
    except OSError:
        pass
