"""Logprobs as the OpenAI API gives them, from what the nodes send.

A node sends, per sampled token, ``[logprob, [[id, logprob], ...]]`` (``compute.node.service``):
the log-softmax of the model's raw logits for the chosen token and the ``k`` most likely ones.
Here they become

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``;
- completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``
  (``text_offset``: where each token starts in the choice's text, echoed prompt included).

A token's string is its bytes decoded with replacement (a byte-level token may be part of a UTF-8
character: its ``bytes`` say which).
"""

from __future__ import annotations


def _piece(bundle, token_id: int) -> tuple[str, list[int]]:
    b = bundle.token_bytes(token_id)
    return b.decode("utf-8", errors="replace"), list(b)


def chat_entries(bundle, token_ids: list[int], lps: list) -> list[dict]:
    """``content`` items of chat logprobs for ``token_ids`` (aligned with the node's ``lps``)."""
    out = []
    for tid, (lp, top) in zip(token_ids, lps):
        s, b = _piece(bundle, tid)
        tops = []
        for t, v in top:
            ts, tb = _piece(bundle, t)
            tops.append({"token": ts, "logprob": v, "bytes": tb})
        out.append({"token": s, "logprob": lp, "bytes": b, "top_logprobs": tops})
    return out


class CompletionLogprobs:
    """Completions logprobs, grown delta by delta (``text_offset`` runs on across deltas)."""

    def __init__(self, bundle, offset: int = 0) -> None:
        self.bundle, self.offset = bundle, offset

    def add(self, token_ids: list[int], lps: list | None) -> dict:
        """The logprobs object for these tokens; ``lps`` None: tokens with no logprob (an echoed prompt's first)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        for i, tid in enumerate(token_ids):
            s, _ = _piece(self.bundle, tid)
            tokens.append(s)
            offsets.append(self.offset)
            self.offset += len(s)
            if lps is None or lps[i] is None:
                token_lps.append(None)
                tops.append(None)
                continue
            lp, top = lps[i]
            token_lps.append(lp)
            tops.append({_piece(self.bundle, t)[0]: v for t, v in top})
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def merge(a: dict | None, b: dict) -> dict:
    """Two completions logprobs objects, one after the other."""
    if a is None:
        return b
    return {k: a[k] + b[k] for k in b}
