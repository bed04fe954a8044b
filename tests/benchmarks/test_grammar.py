"""benchmarks/grammar.py: each grammar it times compiles, and none can end within the tokens it runs
(every step then masks every row: the cost it reports is per masked step)."""

from __future__ import annotations

from benchmarks.grammar import LONG, grammars_to_run


def test_grammars_compile_and_cannot_end_early(real_grammars):
    g, bundle = real_grammars
    text = "word " * (LONG // 10)  # half the characters any of them needs before its end
    starts = {"json_schema": '{"answer":"', "regex": "", "lark": '<tool_call>\n{"name":"search","arguments":{"query":"'}
    for name, spec in grammars_to_run().items():
        m = g.matcher(spec)
        ids = bundle.encode(starts[spec["type"]] + text)
        assert m.try_consume_tokens(ids) == len(ids), name
        assert not m.is_accepting() and not m.is_stopped(), name
