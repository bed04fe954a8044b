"""Effect of wire compression on output, on the real model: teacher-forced top-1 agreement.

The prompt's KV goes through a codec (encode -> decode) into fresh blocks, then the
reference continuation is scored in one chunk against the same computation on the
uncompressed KV: identical kernels, only the KV differs. Free-running greedy agreement
(every token after a first flip counts as lost) is printed too, not asserted.

Two runtimes of the same int8 import:

- fp32 activations (``weights="fp32"``: the int8 weights dequantized once). Here the
  measurement has no noise floor (fp16 on the wire agrees 100% here), so it judges the codec.
- the int8 runtime under ``kernels = invariant``: one plan for the whole test (in process, the
  measured plan would be swapped in whenever its background measurement ends, between two scorings),
  one row-invariant kernel per shape at every M: int8mm or a bf16 GEMM on the CPUs seen, both on
  bf16-cast inputs (the measured plan may run fp32 dequant at some M). Each matmul input is rounded
  to bf16 (2^-8), so ANY perturbation of the KV, even fp16's 2^-11, moves some roundings and flips
  near-ties: fp16 and int8 both land near 97-98%. There int8 must do no worse than fp16.

No threshold is a constant: each codec is judged against a finer control measured in the
same run, on the same tokens (``floor``): ``none`` (the KV unchanged) must agree exactly (else
the scoring is not deterministic and judges nothing), fp16 is judged against ``none`` on
fp32 activations, int8 against fp16 on both runtimes. The margin, in flipped tokens out of
the n scored: ``CODEC_BUDGET`` * n (what a codec may cost on its own: 1%) plus ``SIGMAS``
standard deviations of the difference of two flip counts (near-tie flips are rare events,
about Poisson: sd sqrt(2 * control's flips)). Measured on the AVX-512 box: fp32 activations
fp16 100%, int8 99.71% (floor 99%) over 341 tokens; int8 runtime fp16 97.89%, int8 96.84%
(floor 92.7%) over 95 tokens; a fixed 97% had failed there.
"""

from __future__ import annotations

import math

import pytest

from compute.engine.sampling import SamplingParams
from compute.engine.sequence import Sequence
from compute.kv_transfer import KVLayout
from compute.kv_transfer.compression import CODECS
from compute.modeling.batch import ForwardBatch
from tests.prompts import QUESTIONS

pytestmark = pytest.mark.slow
N = 32
CODEC_BUDGET = 0.01  # flips a codec may add on its own, as a fraction of the scored tokens
SIGMAS = 2.0  # allowance for the count noise of near-tie flips (see ``floor``)
MORE_QUESTIONS = ["Explain what a CPU does.", "List three primary colors.", "What is photosynthesis?",
                  "Name a famous painter.", "How many legs does a spider have?", "Give me a synonym for happy."]  # fmt: skip


def _engine(real_model_store, weights: str):
    from compute.engine.engine import Engine
    from compute.modeling.loader import WeightInjector
    from paramstore import ParamStore, StoreConfig

    locations, name = real_model_store
    store = ParamStore(StoreConfig(locations=locations))
    inj = WeightInjector(store, name, weights, kernels="invariant").start()  # int8: one plan (the module doc)
    assert inj.wait(120)
    store.close()
    # an fp32 cache on both runtimes: the codecs are judged on fp32 KV (on the default bf16 cache fp16 is
    # lossless, so it could no longer measure the runtime's noise floor)
    return Engine.for_model(inj.model, num_blocks=256, kv_cache_dtype="float32"), inj.bundle, inj.model


def _run(eng, seq):
    eng.scheduler.add(seq)
    while eng.has_unfinished():
        eng.step()
    return seq.output_token_ids


def _score(model, cache, ids, cont, blocks, bs):
    """Logits argmax at each continuation position, the prompt's KV already in `blocks`."""
    fb = ForwardBatch.build([cont], [len(ids)], [blocks], bs, all_logits=True)
    return model(fb, cache).argmax(-1).tolist()


def _scored(sch, cache, model, ids, want, payload):
    """Teacher-forced argmaxes over `want` with `payload` as the prompt's KV, in fresh blocks."""
    seq = Sequence(ids + want, SamplingParams(max_tokens=1, temperature=0))
    dst, _ = sch.add_imported(seq, len(ids))
    sch.blocks.allocate(seq, len(ids) + len(want))
    cache.kv[:, :, dst[: payload.shape[2]]] = payload
    out = _score(model, cache, ids, want, list(seq.block_table), cache.block_size)
    sch.abort(seq.seq_id)
    return out


def _start_free_running(sch, cache, ids, want, payload) -> Sequence:
    """A greedy decode from `payload` as the prompt's KV, first token given (run by the next steps)."""
    seq = Sequence(ids + want[:1], SamplingParams(max_tokens=len(want) - 1, temperature=0, ignore_eos=True))
    dst, _ = sch.add_imported(seq, len(ids))
    cache.kv[:, :, dst] = payload
    sch.activate(seq.seq_id)
    return seq


def floor(control: float, n: int) -> float:
    """The least agreement a codec must reach over ``n`` tokens, given a finer control's.

    control - (CODEC_BUDGET * n + SIGMAS * sqrt(2 * max(control_flips, 1))) / n: a noisy control
    widens it by the count noise; a control that flipped nothing counts as one flip (zero seen in n
    does not make the rate zero: on the int8 runtime with a fp32 cache, fp16 flipped 0 of 100 tokens
    and int8 2, where an earlier tree gave fp16 ~2 of 95)."""
    flips = (1 - control) * n
    return control - (CODEC_BUDGET * n + SIGMAS * math.sqrt(2 * max(flips, 1))) / n


def _agreement(engine, codecs, questions, tokens: int, free_running: str | None = None) -> dict[str, float]:
    """codec -> teacher-forced top-1 agreement with the uncompressed KV; "n" -> tokens scored.

    References and free-running decodes run batched (outputs are batch-invariant: tested in
    tests/compute/modeling/test_realmodel.py)."""
    eng, bundle, model = engine
    sch, cache = eng.scheduler, eng.runner.cache
    c = model.config
    layout = KVLayout(c.num_layers, cache.block_size, c.num_kv_heads, c.head_dim, cache.dtype)
    prompts = [bundle.encode(bundle.render_chat([{"role": "user", "content": q}])) for q in questions]
    wants = eng.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0))
    same = dict.fromkeys(codecs, 0)
    forced, to_free_run = 0, []
    for ids, want in zip(prompts, wants):
        pre = Sequence(ids, SamplingParams(max_tokens=1, temperature=0))
        pre.hold_kv = True
        _run(eng, pre)
        kv = cache.kv[:, :, sch.held[pre.seq_id]].clone()
        sch.release(pre.seq_id)
        ref = _scored(sch, cache, model, ids, want, kv)
        forced += len(ref)
        for codec in codecs:
            decoded = CODECS[codec].decode(CODECS[codec].encode(kv), layout)
            same[codec] += sum(a == b for a, b in zip(ref, _scored(sch, cache, model, ids, want, decoded)))
            if codec == free_running:
                to_free_run.append((ids, want, decoded))
    runs = [(_start_free_running(sch, cache, *x), x[1]) for x in to_free_run]
    while eng.has_unfinished():
        eng.step()
    free_same = sum(sum(a == b for a, b in zip(want[:1] + seq.output_token_ids, want)) for seq, want in runs)
    free_total = sum(len(want) for _, want in runs)
    assert sch.blocks.num_free == sch.blocks.num_blocks and not sch.held  # nothing leaked
    runtime = "int8 runtime (bf16 matmul inputs)" if model.lm_head.is_int8 else "fp32 activations"
    for codec in codecs:
        free = f", free-running greedy agreement {free_same / free_total:.2%}" if codec == free_running else ""
        print(f"{runtime}, {codec}: wire {CODECS[codec].ratio(layout):.2f}x smaller than fp32, teacher-forced "
              f"top-1 agreement {same[codec] / forced:.2%} over {forced} tokens{free}")  # fmt: skip
    return {codec: same[codec] / forced for codec in codecs} | {"n": forced}


def test_int8_kv_agreement_at_least_99_percent(real_model_store):
    """fp32 activations: the codec alone decides; fp16 agrees (almost) fully, int8 within 1% of it."""
    engine = _engine(real_model_store, "fp32")
    questions = QUESTIONS + MORE_QUESTIONS
    got = _agreement(engine, ("none", "fp16", "int8"), questions, N, free_running="int8")
    n = got["n"]
    assert got["none"] == 1.0, got  # the unchanged KV: a deterministic measurement
    assert got["fp16"] >= floor(got["none"], n) and got["int8"] >= floor(got["fp16"], n), (
        got, floor(got["none"], n), floor(got["fp16"], n))  # fmt: skip


def test_int8_kv_agreement_matches_half_precision_on_int8_runtime(real_model_store):
    """The int8 runtime (bf16-rounded matmul inputs): int8 on the wire flips no more than fp16 does."""
    engine = _engine(real_model_store, "int8")
    got = _agreement(engine, ("none", "fp16", "int8"), QUESTIONS, 20, free_running="int8")
    n = got["n"]
    assert got["none"] == 1.0, got
    assert got["int8"] >= floor(got["fp16"], n), (got, floor(got["fp16"], n))
