"""The node's ``weight_copies_gb`` as a user sets it (compute/node/config.py): 0 (none) by default, a budget by
flag or ``[node]``, and a bad value refused with a message that names the field and what to set."""

from __future__ import annotations

import pytest

from compute.node.config import NodeConfig
from tests.cli import PDSERVE, resolved, run

TOKEN = {"PDSERVE_INTERNAL_TOKEN": "t"}
NODE = PDSERVE + ["node", "--role", "both", "--model", "m"]


@pytest.mark.parametrize("bad", [-2.0, -0.5, float("nan")])
def test_a_bad_budget_is_refused_with_what_to_set(bad):
    with pytest.raises(ValueError, match=r"weight_copies_gb .*-1 \(no limit.*0 \(none.*GiB"):
        NodeConfig(role="both", internal_token="t", weight_copies_gb=bad)


def test_no_copies_by_default_a_budget_by_flag_or_file(tmp_path):
    assert resolved(NODE, TOKEN)["weight_copies_gb"] == 0
    assert resolved(NODE + ["--weight-copies-gb", "-1"], TOKEN)["weight_copies_gb"] == -1
    path = tmp_path / "pdserve.toml"
    path.write_text("[node]\nweight_copies_gb = 1\n")
    assert resolved(NODE + ["--config", str(path)], TOKEN)["weight_copies_gb"] == 1.0
    assert resolved(NODE + ["--config", str(path), "--weight-copies-gb", "0.25"], TOKEN)["weight_copies_gb"] == 0.25


@pytest.mark.parametrize("toml, flag", [('weight_copies_gb = "lots"', []), ("", ["--weight-copies-gb", "-3"])])
def test_a_bad_budget_from_the_file_or_a_flag_exits_2_naming_the_field(tmp_path, toml, flag):
    path = tmp_path / "pdserve.toml"
    path.write_text(f"[node]\n{toml}\n")
    r = run(NODE + ["--config", str(path), *flag, "--print-config"], TOKEN)
    assert r.returncode == 2 and "weight_copies_gb" in r.stderr and "Traceback" not in r.stderr, r.stderr
