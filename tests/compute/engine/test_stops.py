"""The one rule for where visible text ends (compute/engine/stops.py): stop strings and held-back markers."""

from __future__ import annotations

import pytest

from compute.engine.stops import held_back, visible_end


@pytest.mark.parametrize("buf, markers, want", [
    ("hello", [], (5, None)),
    ("hello wor", ["world"], (6, None)),  # "wor" may begin the stop string: held back
    ("hello world!", ["world"], (6, "world")),
    ("ab STOP cd END", ["END", "STOP"], (3, "STOP")),  # the earliest wins
    ("text <tool_", ["<tool_call>"], (5, None)),
    ("x<", ["<tool_call>", "<|im_end|>"], (1, None)),
    ("abc", ["bcd", "c"], (2, "c")),
])  # fmt: skip
def test_visible_end(buf, markers, want):
    assert visible_end(buf, markers) == want


def test_held_back_is_only_what_may_begin_a_marker():
    assert held_back("the end is ne", ["near"]) == 2 and held_back("xyz", ["near"]) == 0
