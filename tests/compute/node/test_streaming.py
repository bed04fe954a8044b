"""A streamed answer's generator is closed by the answer itself when the client goes away mid-stream: not left
suspended at its ``yield`` for the garbage collector (Starlette's ``StreamingResponse`` keeps it referenced until
the response object dies, then it is closed in a task of its own, racing the generators it holds). Driven at the
ASGI level as a server drives it: the client's disconnect arrives while a chunk is being sent; the plain
``StreamingResponse`` as the control."""

from __future__ import annotations

import asyncio

from starlette.responses import StreamingResponse

from compute.node.streaming import ClosingStreamingResponse


async def _serve(cls) -> tuple[list[str], object]:
    """One response of ``cls`` whose client hangs up while the third chunk is sent; -> (events, the response)."""
    events: list[str] = []
    sent = asyncio.Event()

    async def chunks():
        try:
            for i in range(1000):
                yield f"chunk {i}\n"
        finally:
            await asyncio.sleep(0)  # a cleanup that awaits (a node's abort, a slot released): it still runs
            events.append("generator closed")

    bodies = 0

    async def send(message):
        nonlocal bodies
        if message["type"] == "http.response.body":
            bodies += 1
            if bodies == 3:
                sent.set()
                await asyncio.Event().wait()  # the socket's buffer full: blocked until cancelled

    async def receive():
        await sent.wait()
        return {"type": "http.disconnect"}

    response = cls(chunks(), media_type="text/plain")
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET", "path": "/"}
    await asyncio.wait_for(response(scope, receive, send), 10)
    events.append("response ended")
    return events, response


def test_a_client_gone_mid_stream_closes_the_generator_before_the_response_ends():
    events, _ = asyncio.run(_serve(ClosingStreamingResponse))
    assert events == ["generator closed", "response ended"]


def test_the_plain_streaming_response_leaves_it_suspended():
    """The control: what ``ClosingStreamingResponse`` changes (if Starlette starts closing it, this fails: drop ours)."""

    async def go():
        events, response = await _serve(StreamingResponse)
        assert response.body_iterator.ag_frame is not None  # suspended at its yield, not closed
        return list(events)

    assert asyncio.run(go()) == ["response ended"]


def test_a_stream_that_ends_sends_every_chunk_then_the_end():
    async def go():
        response = ClosingStreamingResponse(iter_async(["a", "b"]), media_type="text/plain")
        out = []

        async def send(message):
            out.append(message.get("body", b""))

        async def receive():
            await asyncio.Event().wait()

        await response({"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET", "path": "/"}, receive, send)
        return out

    assert asyncio.run(go()) == [b"", b"a", b"b", b""]


async def iter_async(items):
    for x in items:
        yield x
