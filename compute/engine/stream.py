"""Text streaming over the engine: per request, token ids and text deltas, stop strings and EOS.

Lifecycle of a request through ``TextStream``:

1. ``add(prompt_ids, params, stop)``: the model bundle's EOS ids join the request's
   stop token ids (unless it ignores EOS); the request is queued in the engine.
2. ``step()``: one engine step; each request that got tokens gets one ``StreamEvent``
   with its new token ids and the text they completed (``TextBundle.detokenizer``:
   a delta never ends inside a UTF-8 character).
3. Stop strings: the text of a request is searched for its stop strings as it
   grows; an end that may begin a stop string is held back so a stop string split
   across deltas is never partly emitted (the rule: ``compute.engine.stops.visible_end``). On a match the text is cut
   *before* the stop string, the request is aborted in the engine (its KV blocks
   freed) and finishes with reason ``stop``.
4. The event with ``finished=True`` is the request's last; ``result(id)`` then
   holds its whole output (token ids, text, finish reason, timings).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import msgspec

from compute.engine.engine import Engine
from compute.engine.sampling import SamplingParams
from compute.engine.stops import visible_end
from compute.modeling.tokenizer import IncrementalDetokenizer, TextBundle


@dataclass(slots=True)
class StreamEvent:
    """What one request got from one step."""

    request_id: int
    token_ids: list[int]  # new token ids (the one completing a stop string included)
    text: str  # new text; never a partial UTF-8 character, never part of a stop string
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None


@dataclass(slots=True)
class StreamResult:
    """A request's whole output, complete once ``finish_reason`` is set."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if any
    error: str | None = None
    t_added: float = 0.0  # perf_counter seconds
    t_first_token: float | None = None
    t_finished: float | None = None

    def timings(self) -> dict:
        """Seconds to first token, total, and decode tokens/s after the first token."""
        first = (self.t_first_token or self.t_added) - self.t_added
        total = (self.t_finished or time.perf_counter()) - self.t_added
        decode = total - first
        rate = (len(self.token_ids) - 1) / decode if decode > 0 and len(self.token_ids) > 1 else None
        return {"time_to_first_token_s": round(first, 4), "total_s": round(total, 4),
                "decode_tokens_per_s": round(rate, 2) if rate else None}  # fmt: skip


class _Request:
    __slots__ = ("detok", "pending", "result", "stop")

    def __init__(self, result: StreamResult, detok: IncrementalDetokenizer, stop: tuple[str, ...]):
        self.result, self.detok, self.stop = result, detok, stop
        self.pending = ""  # decoded, not yet emitted


class TextStream:
    """Owns an ``Engine`` and a ``TextBundle``; turns engine steps into text events."""

    def __init__(self, engine: Engine, bundle: TextBundle) -> None:
        self.engine, self.bundle = engine, bundle
        self._live: dict[int, _Request] = {}
        self._done: dict[int, StreamResult] = {}

    def add(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
            stop: Sequence[str] = ()) -> int:  # fmt: skip
        """Queue a request; returns its id. Empty stop strings are refused."""
        params = params or SamplingParams()
        stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        if not params.ignore_eos and self.bundle.eos_token_ids:
            extra = tuple(t for t in self.bundle.eos_token_ids if t not in params.stop_token_ids)
            params = msgspec.structs.replace(params, stop_token_ids=params.stop_token_ids + extra)
        rid = self.engine.add_request(prompt_token_ids, params)
        result = StreamResult(rid, list(prompt_token_ids), t_added=time.perf_counter())
        self._live[rid] = _Request(result, self.bundle.detokenizer(prompt_token_ids), stop)
        return rid

    def abort(self, request_id: int) -> None:
        """Finish a request now (reason ``abort``); its last event comes from no further step."""
        req = self._live.pop(request_id, None)
        if req is not None:
            self.engine.abort(request_id)
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def result(self, request_id: int) -> StreamResult:
        """The output of a request (finished or still running)."""
        req = self._live.get(request_id)
        return req.result if req is not None else self._done[request_id]

    def pop_result(self, request_id: int) -> StreamResult:
        """The output of a finished request, forgotten here afterwards."""
        return self._done.pop(request_id)

    def step(self) -> list[StreamEvent]:
        """One engine step -> one event per request that got tokens or finished."""
        events, outputs = [], self.engine.step()
        now = time.perf_counter()
        for o in outputs:
            req = self._live.get(o.seq_id)
            if req is None:
                continue  # not ours (or aborted meanwhile)
            r = req.result
            if o.new_token_ids and r.t_first_token is None:
                r.t_first_token = now
            r.token_ids.extend(o.new_token_ids)
            delta = req.detok.add(o.new_token_ids) if o.new_token_ids else ""
            if o.finished:
                delta += req.detok.flush()
            text, stop = self._apply_stop(req, delta, final=o.finished)
            r.text += text
            if stop is not None:
                r.stop_string = stop
                self.engine.abort(o.seq_id)  # no-op if the engine finished it in this very step
                reason = "stop"
            else:
                reason = o.finish_reason if o.finished else None
            if reason is not None:
                r.error = o.error
                self._live.pop(o.seq_id)
                self._finish(req, reason)
            events.append(StreamEvent(o.seq_id, list(o.new_token_ids), text, reason is not None, reason, r.error))
        return events

    def run(self) -> Iterator[StreamEvent]:
        """Step until every request has finished, yielding events as they come."""
        while self.has_unfinished():
            yield from self.step()

    # -- internals ---------------------------------------------------------------------------

    def _apply_stop(self, req: _Request, delta: str, final: bool) -> tuple[str, str | None]:
        """New text -> (text to emit now, the stop string found or None); keeps a hold-back."""
        buf = req.pending + delta
        end, hit = visible_end(buf, req.stop)
        if hit is not None or final:
            req.pending = ""
            return (buf[:end] if hit is not None else buf), hit
        req.pending = buf[end:]
        return buf[:end], None

    def _finish(self, req: _Request, reason: str) -> None:
        r = req.result
        r.finish_reason, r.t_finished = reason, time.perf_counter()
        self._done[r.request_id] = r
