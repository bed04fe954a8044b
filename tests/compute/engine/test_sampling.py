"""The sampler's controls, each against its formula, and logprobs against log-softmax of the model's logits."""

from __future__ import annotations

import pytest
import torch

from compute.engine.engine import Engine
from compute.engine.sampling import History, Sampler, SamplingParams
from compute.modeling.batch import ForwardBatch
from compute.modeling.kv_cache import KVCache
from tests.compute.tiny import tiny_model

V = 12


def _logits(seed: int = 0, rows: int = 1) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_penalties_follow_their_formulas():
    raw = _logits(1)
    hist = History([1, 2, 2, 5, 7, 7, 7], prompt_len=3)  # prompt 1 2 2; output 5 7 7 7
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3)
    got = Sampler()._process(raw, [p], [hist])[0]
    want = raw[0].clone()
    for t in (1, 2, 5, 7):  # repetition: prompt and output, sign-aware
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t, n in {5: 1, 7: 3}.items():  # frequency and presence: output only
        want[t] -= 0.25 * n + 0.5
    torch.testing.assert_close(got, want)
    assert torch.equal(Sampler()._process(raw, [SamplingParams()], [hist]), raw)  # nothing asked: untouched


def test_penalties_change_the_greedy_choice():
    raw = torch.zeros(1, V)
    raw[0, 3], raw[0, 4] = 2.0, 1.5
    hist = History([9, 3, 3], prompt_len=1)
    assert Sampler().sample(raw, [SamplingParams(temperature=0)], [3], [hist]).tokens == [3]
    assert Sampler().sample(raw, [SamplingParams(temperature=0, frequency_penalty=0.3)], [3], [hist]).tokens == [4]
    assert Sampler().sample(raw, [SamplingParams(temperature=0, presence_penalty=0.6)], [3], [hist]).tokens == [4]


def test_logit_bias_min_p_and_min_tokens():
    raw = _logits(2)
    top = int(raw[0].argmax())
    biased = SamplingParams(temperature=0, logit_bias={(top + 1) % V: 100.0})
    assert Sampler()(raw, [biased], [0]) == [(top + 1) % V]
    probs = torch.softmax(raw[0], -1)
    kept = Sampler.filtered_probs(raw[0], SamplingParams(min_p=0.3)) > 0
    assert kept.tolist() == (probs >= 0.3 * probs.max()).tolist()
    eos = Sampler(eos_token_ids=(top,))
    early = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=((top + 2) % V,))
    hist = History([0, 1, 5], prompt_len=2)  # one token generated so far
    second = int(raw[0].topk(2).indices[1])
    banned = {top, (top + 2) % V}
    pick = eos(raw, [early], [3], [hist])[0]
    assert pick not in banned and pick == max((t for t in range(V) if t not in banned), key=lambda t: raw[0, t])
    assert eos(raw, [early], [4], [History([0, 1, 5, 6], 2)]) == [top]  # two generated: EOS allowed again
    assert second != top


def test_allowed_token_ids_leave_only_those_tokens_drawable_and_refuse_an_empty_list():
    raw = _logits(4, rows=2)
    top = int(raw[0].argmax())
    allowed = ((top + 1) % V, (top + 5) % V)
    best = max(allowed, key=lambda t: raw[0, t])
    p = SamplingParams(temperature=0, allowed_token_ids=list(allowed))  # a list from the wire: kept as a tuple
    assert p.allowed_token_ids == allowed and Sampler()(raw[:1], [p], [0]) == [best]
    drawn = {Sampler()(raw[:1], [SamplingParams(temperature=1.5, seed=s, allowed_token_ids=allowed)], [0])[0]
             for s in range(40)}  # fmt: skip
    assert drawn == set(allowed)  # both drawn at a high temperature, nothing else
    both = Sampler()(raw, [p, SamplingParams(temperature=0)], [0, 0])  # the other row is untouched
    assert both == [best, int(raw[1].argmax())]
    for bad in ([], [-1]):
        with pytest.raises(ValueError, match="allowed_token_ids"):
            SamplingParams(allowed_token_ids=bad)


def test_rows_are_independent_in_a_batch():
    raw = _logits(3, rows=4)
    ps = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=3, seed=1),
          SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, seed=2), SamplingParams(temperature=0, logprobs=3)]  # fmt: skip
    hs = [History([1, 2], 1)] * 4
    batch = Sampler().sample(raw, ps, [5, 6, 7, 8], hs)
    alone = [Sampler().sample(raw[i : i + 1], [ps[i]], [5 + i], [hs[i]]) for i in range(4)]
    assert batch.tokens == [a.tokens[0] for a in alone]
    assert batch.logprobs[3] == alone[3].logprobs[0] and batch.logprobs[0] is None


def test_logprobs_are_log_softmax_sorted_and_consistent():
    raw = _logits(4, rows=2)
    out = Sampler().sample(raw, [SamplingParams(temperature=0, logprobs=5), SamplingParams(temperature=0, logprobs=0)],
                           [0, 0])  # fmt: skip
    ref = torch.log_softmax(raw, -1)
    lp = out.logprobs[0]
    assert lp.logprob == pytest.approx(float(ref[0, out.tokens[0]]), abs=1e-6)
    assert [t for t, _ in lp.top] == ref[0].topk(5).indices.tolist()
    values = [v for _, v in lp.top]
    assert values == sorted(values, reverse=True) and lp.top[0] == (out.tokens[0], pytest.approx(lp.logprob))
    assert out.logprobs[1].top == []


def test_invalid_controls_are_refused():
    for bad in ({"min_p": 1.5}, {"presence_penalty": 3}, {"repetition_penalty": 0}, {"min_tokens": -1},
                {"logprobs": 21}, {"logit_bias": {3: 200}}):  # fmt: skip
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def _reference_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every position of ``ids`` (one fp32 forward, no engine)."""
    nb = -(-len(ids) // 8)
    fb = ForwardBatch.build([ids], [0], [list(range(nb))], 8, all_logits=True)
    return torch.log_softmax(model(fb, KVCache(model.config, nb, 8)), -1)


@pytest.mark.parametrize("chunk", [512, 5])
def test_engine_logprobs_equal_the_reference(chunk):
    """Greedy output's logprobs, and the prompt's (echo scoring), equal log-softmax of one fp32 forward over
    prompt + output; chunked prefill gives the same prompt logprobs."""
    model = tiny_model(seed=5)
    prompt = [3, 17, 42, 8, 99, 4, 23]
    eng = Engine.for_model(model, num_blocks=32, max_num_batched_tokens=chunk)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    sid = eng.add_request(prompt, sp)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.seq_id == sid]
    tokens = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.logprobs]
    plps = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(plps) == 1 and outs[0].prompt_logprobs is plps[0]  # once, with the first token
    ref = _reference_logprobs(model, prompt + tokens)
    for i, (t, lp) in enumerate(zip(tokens, lps)):
        row = ref[len(prompt) - 1 + i]
        assert lp.logprob == pytest.approx(float(row[t]), abs=1e-4)
        assert [x for x, _ in lp.top] == row.topk(2).indices.tolist() and lp.top[0][0] == t  # greedy: the top one
    assert plps[0][0] is None and len(plps[0]) == len(prompt)
    for p in range(1, len(prompt)):
        assert plps[0][p].logprob == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
