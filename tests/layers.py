"""The layering the import rules hold the code to (tests/test_layering.py checks them): the packages, lowest
first, and, inside compute and gateway, their rooms, lowest first."""

from __future__ import annotations

RANK = {"paramstore": 0, "compute": 1, "gateway": 2, "autoscaler": 3, "benchmarks": 4}
LIBRARY = ("paramstore", "compute", "gateway", "autoscaler")

# the rooms of a package, lowest first: a room may import itself and the rooms before it
ROOMS = {
    "compute": ("errors", "kernels", "modeling", "engine", "kv_transfer", "node"),
    "gateway": ("config", "keyfile", "models", "routing", "admission", "api", "service", "routes", "app", "main",
                "status", "chat"),
}  # fmt: skip
