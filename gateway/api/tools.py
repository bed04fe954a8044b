"""Tool calling: the tools a chat request offers, rendered by the model's chat template, and the calls
parsed out of its answer into ``tool_calls``.

Lifecycle, per chat request (``plan``):

1. ``plan(req, bundle, model)`` checks what the request asks against the model: its chat template must
   render ``tools`` and write calls in a format pdserve parses (Hermes: ``<tool_call>{json}</tool_call>``,
   as Qwen2.5, Hermes and SmolLM3 do); else a 400 saying which. No tools: ``None``.
2. The prompt is rendered with ``tools`` in the template's (HF) form, assistant ``tool_calls`` with
   their arguments as objects (``template_messages``).
3. ``tool_choice`` "required" or a named function: the nodes enforce a grammar (``ToolPlan.grammar``,
   llguidance lark with each tool's parameters as JSON schema) that admits only calls, so the answer
   always parses. "auto": the model chooses; "none": the answer is text, not parsed.
4. The answer goes through one ``CallParser`` per choice, streamed or not (the same parser both ways):
   text outside calls is content, each complete call a ``tool_calls`` entry; the finish reason of an
   answer that called a tool is "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints

from compute.engine.stops import held_back

FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]  # OpenAI's rule (and '.')
OPEN, CLOSE = "<tool_call>", "</tool_call>"  # Hermes' call markers


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: FunctionName
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema (none: any object)
    strict: bool | None = None  # tool_choice required/named: always enforced; auto: the model's choice


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDef


class ChosenFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: FunctionName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str  # JSON text, as the API gives it


class MessageToolCall(BaseModel):  # a call in an earlier assistant message
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"]
    function: CalledFunction


class ToolError(ValueError):
    """The request's tools cannot be used with this model or as asked (a 400; ``param`` names the field)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


TEMPLATE_HINT = ("import the model with a template that does: paramstore import SRC --name NAME --chat-template "
                 "deploy/chat-templates/chatml-tools.jinja")  # fmt: skip


def supported(bundle) -> bool:
    """Whether the model's chat template renders tools and writes calls as pdserve parses them."""
    return bundle.template_uses("tools") and OPEN in (bundle.chat_template or "")


def plan(req, bundle, model: str) -> ToolPlan | None:
    """What ``req`` asks of tools, checked against the model's chat template; None: no tools."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise ToolError("tool_choice needs tools: the request offers none", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise ToolError("tools: two tools have the same name", "tools")
    if not bundle.template_uses("tools"):
        raise ToolError(f"model {model!r}: its chat template does not render tools, so the model cannot be "
                        f"offered them ({TEMPLATE_HINT})", "tools")  # fmt: skip
    if OPEN not in (bundle.chat_template or ""):
        raise ToolError(f"model {model!r}: its chat template renders tools, but not calls in a format pdserve "
                        f"parses (Hermes: {OPEN}{{json}}{CLOSE})", "tools")  # fmt: skip
    choice = choice or "auto"
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ToolError(f"tool_choice: no tool is named {choice.function.name!r} (tools: {', '.join(names)})",
                        "tool_choice")  # fmt: skip
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise ToolError("tool_choice required or named and response_format both constrain the answer: ask one",
                        "response_format")  # fmt: skip
    offered = [t.model_dump(exclude_none=True) for t in req.tools]
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(offered, None, parallel, parse=False)
    chosen = [t for t in req.tools if not isinstance(choice, NamedToolChoice) or t.function.name == choice.function.name]
    return ToolPlan(offered, calls_grammar(chosen, parallel and choice == "required") if forced else None, parallel)


@dataclass(slots=True)
class ToolPlan:
    offered: list[dict]  # the tools as the template gets them
    grammar: dict | None  # the nodes' grammar spec (compute.engine.grammar): calls only; None: the model chooses
    parallel: bool  # several calls in one answer (parallel_tool_calls); False: the first only
    parse: bool = True  # tool_choice none: the answer is text

    def parser(self) -> CallParser | None:
        return CallParser(self.parallel) if self.parse else None


def calls_grammar(tools: list[Tool], several: bool) -> dict:
    """A lark grammar (llguidance) admitting Hermes calls of ``tools`` only: one, or (``several``) one or more."""
    bodies = []
    for t in tools:
        params = t.function.parameters or {"type": "object"}
        bodies.append({"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": params},
                       "required": ["name", "arguments"], "additionalProperties": False})  # fmt: skip
    schema = {"anyOf": bodies, "x-guidance": {"whitespace_flexible": False}}  # compact: no whitespace loops
    start = 'start: call ("\\n" call)*' if several else "start: call"
    text = f'{start}\ncall: "{OPEN}\\n" body "\\n{CLOSE}"\nbody: %json {json.dumps(schema)}\n'
    return {"type": "lark", "grammar": text}


def template_messages(messages) -> list[dict]:
    """Request messages as chat templates read them (HF's form): an assistant's earlier calls with their
    arguments as objects, a tool result with its call id."""
    out = []
    for m in messages:
        d = {"role": m.role, "content": m.text()}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function",
                                "function": {"name": c.function.name, "arguments": _object(c.function.arguments)}}
                               for c in m.tool_calls]  # fmt: skip
        out.append(d)
    return out


def _object(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # not JSON: the template gets the text


class CallParser:
    """One answer's text, fed as it streams, split into content and calls (Hermes format).

    A call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text that may still become a
    marker is held back; a block that is not such JSON stays content, verbatim. Whitespace between
    calls is not content. ``feed`` and ``finish`` return (content to emit, calls completed)."""

    __slots__ = ("buf", "calls", "held", "inside", "parallel")

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.buf, self.inside, self.held, self.calls = "", False, "", 0

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        out, calls = "", []
        while True:
            if not self.inside:
                i = self.buf.find(OPEN)
                if i < 0:
                    cut = len(self.buf) - held_back(self.buf, (OPEN,))
                    out, self.buf = out + self._content(self.buf[:cut]), self.buf[cut:]
                    return out, calls
                out, self.buf, self.inside = out + self._content(self.buf[:i]), self.buf[i + len(OPEN) :], True
            else:
                i = self.buf.find(CLOSE)
                if i < 0:
                    return out, calls
                body, self.buf, self.inside = self.buf[:i], self.buf[i + len(CLOSE) :], False
                out += self._called(body, calls)

    def finish(self) -> tuple[str, list[dict]]:
        """The end of the answer: a call left open is parsed as it stands; held text is content."""
        out, calls = self.feed("")
        if self.inside:
            out += self._called(self.buf, calls, closed=False)
        elif self.buf:
            out += self._content(self.buf)
        self.buf, self.inside = "", False
        if self.held and not self.calls:  # whitespace around no call: it was content
            out, self.held = out + self.held, ""
        return out, calls

    def _called(self, body: str, calls: list, closed: bool = True) -> str:
        """A call's body: appended to ``calls`` (-> ""), or, not a call, the content it stays."""
        call = _call(body)
        if call is None:
            return self._content(OPEN + body + (CLOSE if closed else ""))
        if self.parallel or not self.calls:
            calls.append(call)
            self.calls += 1
        self.held = ""  # whitespace before a call is not content
        return ""

    def _content(self, text: str) -> str:
        """Content to emit now: whitespace is held until text follows it (none may: a call may)."""
        text, self.held = self.held + text, ""
        cut = len(text.rstrip())
        text, self.held = text[:cut], text[cut:]
        return text


def _call(body: str) -> dict | None:
    """A Hermes call's JSON -> the API's tool call (arguments as JSON text), or None if it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else
                         json.dumps(args, ensure_ascii=False)}}  # fmt: skip


def message(parser: CallParser | None, text: str, reason: str | None) -> tuple[dict, str | None]:
    """An unstreamed answer as the assistant message (content, tool_calls) and its finish reason."""
    if parser is None:
        return {"role": "assistant", "content": text}, reason
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    content, calls = content + rest, calls + more
    if not calls:
        return {"role": "assistant", "content": content}, reason
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, _reason(reason)


def _reason(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


def stream_delta(parser: CallParser, text: str, reason: str | None) -> tuple[str, list[dict], str | None]:
    """A streamed delta through the parser: (content, tool_calls delta entries, finish reason)."""
    content, calls = parser.feed(text)
    if reason is not None:
        rest, more = parser.finish()
        content, calls = content + rest, calls + more
    first = parser.calls - len(calls)  # indexes of this answer's calls
    entries = [{"index": first + i, **c} for i, c in enumerate(calls)]
    return content, entries, (_reason(reason) if parser.calls else reason)
