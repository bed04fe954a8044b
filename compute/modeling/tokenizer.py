"""The model bundle's text side: tokenizer, chat template and streaming detokenization.

Built from the files the store keeps beside the weights (``tokenizer.json``,
``tokenizer_config.json``, ``generation_config.json``) with the `tokenizers`
library and a sandboxed jinja2 environment, as transformers renders chat templates.
``IncrementalDetokenizer`` turns a growing list of token ids into text deltas that
never split a UTF-8 character (vLLM's prefix/read offsets).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field


class TemplateError(ValueError):
    """The chat template rejected the messages (a request error: fix the messages)."""


@dataclass(slots=True)
class TextBundle:
    tokenizer: object  # tokenizers.Tokenizer
    chat_template: str | None
    eos_token_ids: tuple[int, ...]
    bos_token: str | None = None
    eos_token: str | None = None
    special: dict = field(default_factory=dict)

    @classmethod
    def from_files(cls, files: dict[str, bytes]) -> "TextBundle":
        from tokenizers import Tokenizer

        if "tokenizer.json" not in files:
            raise ValueError("the model bundle has no tokenizer.json")
        tok = Tokenizer.from_str(files["tokenizer.json"].decode())
        tcfg = json.loads(files.get("tokenizer_config.json", b"{}") or b"{}")
        gcfg = json.loads(files.get("generation_config.json", b"{}") or b"{}")
        template = tcfg.get("chat_template")
        if "chat_template.jinja" in files:
            template = files["chat_template.jinja"].decode()
        eos = gcfg.get("eos_token_id", tcfg.get("eos_token_id"))
        eos_name = _token_name(tcfg.get("eos_token"))
        if eos is None and eos_name is not None:
            eos = tok.token_to_id(eos_name)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(tok, template, tuple(int(e) for e in eos_ids), _token_name(tcfg.get("bos_token")), eos_name, tcfg)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:  # fmt: skip
        """Messages (and the tools offered, HF's form) -> prompt text through the model's chat template."""
        if not self.chat_template:
            raise TemplateError("this model has no chat template; use the completions API")
        import jinja2

        extra = {"tools": tools} if tools is not None else {}
        try:
            return _compiled_template(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"chat template failed: {e}") from None

    def template_uses(self, name: str) -> bool:
        """Whether the chat template reads the variable ``name`` (e.g. "tools": it renders them)."""
        return bool(self.chat_template) and name in _template_variables(self.chat_template)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (a byte-level BPE token may be part of a UTF-8 character;
        the OpenAI API's logprobs carry them as ``bytes``)."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        table = _byte_decoder()
        if piece not in self.special.values() and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return self.tokenizer.decode([token_id], skip_special_tokens=False).encode()

    def detokenizer(self, prompt_ids: list[int] | None = None) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self.tokenizer, prompt_ids or [])


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, char -> byte (printable bytes as themselves, the rest shifted past 255)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars)}


def _raise_exception(msg):
    raise TemplateError(msg)


@functools.lru_cache(maxsize=16)
def _compiled_template(source: str):
    """The chat template compiled once (compiling costs ~10 ms, rendering ~0.1 ms); a sandbox."""
    return _environment().from_string(source)


@functools.cache
def _environment():
    """The sandbox chat templates run in, with transformers' additions: ``raise_exception``,
    ``strftime_now`` and a ``tojson`` that does not escape HTML (templates write tools with it)."""
    import datetime

    import jinja2.sandbox

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)  # fmt: skip
    return env


@functools.lru_cache(maxsize=16)
def _template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its caller (jinja2's AST)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(source)))


def _token_name(v) -> str | None:
    if isinstance(v, dict):
        return v.get("content")
    return v


class IncrementalDetokenizer:
    """Token ids in, text deltas out; a delta never ends inside a UTF-8 character.

    Decodes a short window (from ``prefix`` to the end) and emits what is new
    beyond ``read``, holding back text while it ends in U+FFFD (an incomplete
    byte sequence). Context from the prompt keeps spacing right at the start.
    """

    __slots__ = ("tok", "ids", "prefix", "read", "text")

    def __init__(self, tokenizer, prompt_ids: list[int]):
        self.tok = tokenizer
        self.ids = list(prompt_ids[-6:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly completed text (possibly empty)."""
        self.ids.extend(token_ids)
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
            delta = full[len(prefix_text) :]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is still held back (may hold U+FFFD)."""
        prefix_text = self.tok.decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        full = self.tok.decode(self.ids[self.prefix :], skip_special_tokens=True)
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self.prefix = self.read = len(self.ids)
        self.text += delta
        return delta
