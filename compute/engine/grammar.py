"""Structured output: a request's grammar (JSON object, JSON schema, regex, lark) enforced token by token.

Lifecycle, per request that asks for one (``SamplingParams.grammar``: the spec as the API gave it):

1. ``Grammars.matcher(spec, output)`` compiles the spec with llguidance (once per distinct spec: an
   LRU of compiled grammars) and returns a matcher that has consumed the request's output so far
   (a decode node's first token, a failover's replayed tokens: the same state wherever it runs);
   an invalid spec raises ``InvalidGrammar`` (the request's 400);
2. each step, the sampler asks every constrained row's matcher for its token bitmask and masks the
   logits before anything else (``Sampler``); EOS is allowed only where the grammar accepts;
3. the sampled token is consumed; a matcher that reached the end of its grammar allows only EOS.

Why llguidance (measured on the Intel AMX box, SmolLM2's 49152-token vocabulary, a 3-field JSON schema,
30-token answer): per step, the mask of one matcher took 12 us (median) with llguidance, 5 us with
xgrammar; 32 matchers 337 us and 71 us; a step of the model is ~25 ms (1 stream) to ~90 ms (32), so
either is under 0.5%. llguidance has no dependencies; xgrammar 0.2.9 pulls in transformers and triton
on Linux. outlines-core was not measured.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
from collections import OrderedDict

import torch

JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON: a small model cannot loop on whitespace


class InvalidGrammar(ValueError):
    """The request's structured-output spec cannot be compiled: fix the schema or pattern (a 400)."""


def grammar_text(spec: dict) -> str:
    """llguidance's grammar for an API spec: {"type": "json_object"} | {"type": "json_schema", "schema": {...}}
    | {"type": "regex", "pattern": "..."} | {"type": "lark", "grammar": "..."} (llguidance's lark: the
    gateway's tool-call grammar, gateway/api/tools.py)."""
    import llguidance

    kind = spec.get("type")
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise InvalidGrammar("json_schema needs a schema object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as e:
            raise InvalidGrammar(f"json_schema: {e}") from None
    if kind == "regex":
        pattern = spec.get("pattern")
        if not isinstance(pattern, str) or not pattern:
            raise InvalidGrammar("regex needs a non-empty pattern")
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    if kind == "lark":
        text = spec.get("grammar")
        if not isinstance(text, str) or not text:
            raise InvalidGrammar("lark needs a non-empty grammar")
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise InvalidGrammar(f"unknown grammar type {kind!r}: json_object, json_schema, regex or lark")


MAX_SPEC_BYTES = 256 << 10  # a JSON schema, regex or lark grammar as the request sent it


class Grammars:
    """One model's tokenizer as llguidance sees it, and its compiled grammars (an LRU by spec)."""

    def __init__(self, tokenizer_json: bytes, vocab_size: int, eos_token_ids: tuple[int, ...], cache: int = 64):
        import llguidance

        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:  # llguidance reads a path
            f.write(tokenizer_json)
        try:
            self.tokenizer = llguidance.LLTokenizer(f.name, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        finally:
            os.unlink(f.name)
        self.vocab_size = vocab_size
        self._compiled: OrderedDict[str, str] = OrderedDict()
        self._cache = cache

    def matcher(self, spec: dict, output: list[int] = ()):
        """A matcher for ``spec`` that has consumed ``output`` (tokens this request already generated)."""
        import llguidance

        key = json.dumps(spec, sort_keys=True)
        if len(key) > MAX_SPEC_BYTES:  # compiling is CPU (in a node's worker thread): a bounded one
            raise InvalidGrammar(f"grammar of {len(key)} bytes is over the {MAX_SPEC_BYTES}-byte limit")
        text = self._compiled.get(key)
        if text is None:
            text = grammar_text(spec)
            err = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
            if err:
                raise InvalidGrammar(err)
            self._compiled[key] = text
            if len(self._compiled) > self._cache:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        m = llguidance.LLMatcher(self.tokenizer, text)
        if output and not m.consume_tokens(list(output)):
            raise InvalidGrammar(f"the output so far does not fit the grammar: {m.get_error()}")
        return m


def mask_logits(x: torch.Tensor, matchers: list) -> None:
    """x: [R, V] logits, one matcher per row: tokens the grammar does not allow next get -inf (in place).

    llguidance fills one bitmask row per matcher (bit t % 32 of word t // 32: token t allowed); the bits
    are unpacked with numpy, not llguidance's own ``apply_token_bitmask_inplace``: that one is a
    ``torch.compile`` kernel, which cost 3 s at a node's first constrained step (and 0.1 s at each new
    batch size), and whose AVX2 code masked only half the vocabulary (torch 2.13, ATen dispatch AVX2)."""
    import numpy as np

    rows, vocab = x.shape
    bm = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)  # [R, W] words, little-endian
    if rows == 1:  # what llguidance.torch.fill_next_token_bitmask does (importing it: 1.5 s)
        matchers[0].unsafe_compute_mask_ptr(bm.data_ptr(), bm.shape[1] * 4)
    else:  # rows in parallel, on as many threads as torch has (it waits meanwhile)
        _executor(torch.get_num_threads()).unsafe_compute_mask_ptr(list(zip(matchers, range(rows))), bm.data_ptr(),
                                                                   bm.shape[1] * 4, rows)  # fmt: skip
    allowed = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]  # [R, V] 0/1
    x.masked_fill_(torch.from_numpy(allowed == 0).to(x.device), float("-inf"))


@functools.cache
def _executor(threads: int):
    import llguidance

    return llguidance.LLExecutor(num_threads=threads)
