"""compute/engine/grammar.py with the sampler, over SmolLM2's real tokenizer: every grammar kind compiles and
masks, a bad spec is InvalidGrammar, and a grammar at its end beats min_tokens (no NaN, the answer ends)."""

from __future__ import annotations

import pytest
import torch

from compute.engine.grammar import InvalidGrammar
from compute.engine.sampling import History, Sampler, SamplingParams

V = 49152


@pytest.mark.parametrize("spec,ok,bad", [
    ({"type": "json_object"}, '{"a":1}', "[1]"),
    ({"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}},
     '{"n":3}', '{"n":"x"}'),
    ({"type": "regex", "pattern": "ab+c"}, "abbc", "ac"),
    ({"type": "lark", "grammar": 'start: "yes" | "no"'}, "no", "maybe"),
])  # fmt: skip
def test_each_kind_accepts_its_language_only(real_grammars, spec, ok, bad):
    g, bundle = real_grammars
    for s, want in ((ok, True), (bad, False)):
        m = g.matcher(spec)
        ids = bundle.encode(s)
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) is want, s


@pytest.mark.parametrize("spec", [{"type": "lark", "grammar": "start: ("}, {"type": "lark"}, {"type": "xml"},
                                  {"type": "regex", "pattern": ""},
                                  {"type": "regex", "pattern": "a" * (300 << 10)}])  # fmt: skip  (over the size limit)
def test_a_bad_spec_is_invalid_grammar(real_grammars, spec):
    with pytest.raises(InvalidGrammar):
        real_grammars[0].matcher(spec)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (1.0, 1e-45)])
def test_a_grammar_at_its_end_beats_min_tokens(real_grammars, temperature, top_p):
    """The grammar allows only EOS; min_tokens bans EOS: every logit would be -inf (a NaN draw, a node error
    before). The grammar wins: EOS is drawn, and a row without the conflict in the same batch is untouched."""
    g, bundle = real_grammars
    spec = {"type": "regex", "pattern": "ab"}
    done = g.matcher(spec, bundle.encode("ab"))
    fresh = g.matcher(spec)
    params = SamplingParams(temperature=temperature, top_p=top_p, min_tokens=50, seed=1, grammar=spec)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
    hist = [History([5, 6, *bundle.encode("ab")], 2), History([5, 6], 2)]
    out = Sampler(eos_token_ids=bundle.eos_token_ids).sample(logits, [params, params], [4, 2], hist, [done, fresh])
    assert out.tokens[0] in bundle.eos_token_ids and done.is_stopped()
    assert bundle.decode([out.tokens[1]]) in ("a", "ab") and out.tokens[1] not in bundle.eos_token_ids
