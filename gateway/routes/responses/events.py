"""A streamed chat completion as the Responses API's typed event stream (``event: TYPE`` + ``data: {...}``,
each with its ``sequence_number``), in the order the openai SDK's stream helpers read it:

  response.created, response.in_progress                  the response, in progress, no output yet
  per text run:  response.output_item.added (message), response.content_part.added (output_text),
                 response.output_text.delta ..., response.output_text.done, response.content_part.done,
                 response.output_item.done
  per call:      response.output_item.added (function_call), response.function_call_arguments.delta,
                 response.function_call_arguments.done, response.output_item.done
  the end:       response.completed (or response.incomplete: max_output_tokens), with the output and usage;
                 a node lost mid-stream: response.failed, with the error

The chat stream's chunks (``data: {...}``, ``data: [DONE]``) are read as the chat path wrote them; its
generator is closed when this one is (a client that goes away aborts the request on the nodes).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from gateway.routes.responses import translate as t
from gateway.routes.responses.protocol import ResponsesRequest


class ResponseEvents:
    """One response's events, built from its chat chunks."""

    def __init__(self, req: ResponsesRequest, rid: str, created: int) -> None:
        self.req, self.rid, self.created = req, rid, created
        self.seq = 0
        self.output: list[dict] = []  # items done
        self.text: str | None = None  # the open message's text (None: no message open)
        self.msg_id = ""

    def _event(self, type_: str, **fields) -> str:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(body)}\n\n"

    def _envelope(self, status: str, usage: dict | None = None, error: dict | None = None) -> dict:
        return t.envelope(self.req, self.rid, self.created, status, list(self.output), usage, error)

    async def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._envelope("in_progress"))
        yield self._event("response.in_progress", response=self._envelope("in_progress"))
        reason, usage = None, None
        try:
            async for raw in chunks:
                data = raw.removeprefix("data: ").strip()
                if not raw.startswith("data: ") or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    for e in self._close_text("incomplete"):
                        yield e
                    err = {"code": "server_error", "message": chunk["error"]["message"]}
                    yield self._event("response.failed", response=self._envelope("failed", error=err))
                    return
                usage = chunk.get("usage") or usage
                for ch in chunk.get("choices", []):
                    delta = ch.get("delta", {})
                    for e in self._text(delta.get("content") or ""):
                        yield e
                    for call in delta.get("tool_calls") or []:
                        for e in self._call(call):
                            yield e
                    reason = ch.get("finish_reason") or reason
        finally:
            await chunks.aclose()
        status = t.status_of(reason)
        if self.text is None and not self.output:  # an empty answer: one empty message, as unstreamed
            for e in self._text("", start=True):
                yield e
        for e in self._close_text(status):
            yield e
        final = "response.incomplete" if status == "incomplete" else "response.completed"
        yield self._event(final, response=self._envelope(status, t.usage(usage)))

    def _text(self, delta: str, start: bool = False) -> list[str]:
        out = []
        if self.text is None and (delta or start):
            self.text, self.msg_id = "", t.new_id("msg_")
            item = t.message_item("", "in_progress", self.msg_id) | {"content": []}
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=item))
            out.append(self._event("response.content_part.added", item_id=self.msg_id, output_index=len(self.output),
                                   content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        if delta:
            self.text += delta
            out.append(self._event("response.output_text.delta", item_id=self.msg_id, output_index=len(self.output),
                                   content_index=0, delta=delta, logprobs=[]))  # fmt: skip
        return out

    def _close_text(self, status: str) -> list[str]:
        if self.text is None:
            return []
        item, index, text = t.message_item(self.text, status, self.msg_id), len(self.output), self.text
        where = {"item_id": self.msg_id, "output_index": index, "content_index": 0}
        out = [self._event("response.output_text.done", **where, text=text, logprobs=[]),
               self._event("response.content_part.done", **where, part=item["content"][0]),
               self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        self.output.append(item)
        self.text = None
        return out

    def _call(self, call: dict) -> list[str]:
        out = self._close_text("completed")
        item, index = t.call_item(call), len(self.output)
        where = {"item_id": item["id"], "output_index": index}
        out += [self._event("response.output_item.added", output_index=index,
                            item=item | {"arguments": "", "status": "in_progress"}),
                self._event("response.function_call_arguments.delta", **where, delta=item["arguments"]),
                self._event("response.function_call_arguments.done", **where, name=item["name"],
                            arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
        self.output.append(item)
        return out
