"""A streamed HTTP answer whose generator is closed when the answer ends, however it ends.

Starlette's ``StreamingResponse`` iterates its body generator and, when the client goes away while a chunk is being
sent, is cancelled there and drops the generator suspended at its ``yield``: its ``finally`` (a node's abort of the
request, the gateway's release of its slot and abort to the nodes) then runs only when the garbage collector
finalizes it, in a task of its own, racing the finalizers of the generators it holds ("aclose(): asynchronous
generator is already running", "generator didn't stop after athrow()", seen in a soak). ``ClosingStreamingResponse``
closes it at once, shielded from that cancellation and bounded by ``CLOSE_TIMEOUT_S``. Used by every streamed
route (the node's NDJSON, the gateway's SSE).
"""

from __future__ import annotations

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Send

CLOSE_TIMEOUT_S = 10.0  # the most a generator's cleanup may take (an abort sent to a node: its client's timeouts)


class ClosingStreamingResponse(StreamingResponse):
    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
                    await aclose()
