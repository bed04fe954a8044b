"""Streaming detokenization never splits a UTF-8 character and equals a one-shot decode."""

from __future__ import annotations

import json

import pytest

from compute.modeling.tokenizer import TemplateError, TextBundle


@pytest.fixture(scope="module")
def byte_bundle():
    """A byte-level BPE tokenizer with no merges: every byte is its own token (multi-byte chars split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|end|>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    files = {
        "tokenizer.json": tok.to_str().encode(),
        "tokenizer_config.json": json.dumps({
            "eos_token": "<|end|>",
            "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                             "{% if add_generation_prompt %}<assistant>{% endif %}",
        }).encode(),
    }  # fmt: skip
    return TextBundle.from_files(files)


@pytest.mark.parametrize("text", ["héllo wörld", "日本語 🙂 ok", "plain ascii", "ẞ\u200d👩‍👩‍👧"])
def test_stream_deltas_never_split_characters(byte_bundle, text):
    ids = byte_bundle.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: multi-byte chars span tokens
    d = byte_bundle.detokenizer([])
    deltas = [d.add([i]) for i in ids]
    deltas.append(d.flush())
    assert "".join(deltas) == text
    assert all("\ufffd" not in x for x in deltas)


def test_eos_and_chat_template(byte_bundle):
    assert byte_bundle.eos_token_ids == (byte_bundle.tokenizer.token_to_id("<|end|>"),)
    assert byte_bundle.render_chat([{"role": "user", "content": "hi"}]) == "<user>hi<assistant>"


def test_template_errors_are_request_errors(byte_bundle):
    bad = TextBundle(byte_bundle.tokenizer, "{{ raise_exception('roles must alternate') }}", ())
    with pytest.raises(TemplateError, match="alternate"):
        bad.render_chat([{"role": "user", "content": "x"}])
    with pytest.raises(TemplateError, match="no chat template"):
        TextBundle(byte_bundle.tokenizer, None, ()).render_chat([])
