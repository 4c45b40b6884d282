"""The server's streamed answers, on their own: ASGI calls with a client that leaves."""

import asyncio

import pytest

from specdec.serving.answer import ClosingStream

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "method": "POST", "path": "/"}


def test_a_stream_whose_client_left_while_a_chunk_was_sent_is_closed_at_once():
    """Sending a chunk fails when the client has left; Starlette then leaves the events
    suspended, and only their ``finally`` aborts the engine's requests: the stream must run
    it at once, not when the garbage collector finds the events."""
    closed, sent = [], []

    async def events():
        try:
            for i in range(10):
                yield f"data: {i}\n\n"
        finally:
            closed.append(len(sent))

    async def send(message):
        sent.append(message)
        if len(sent) == 3:  # the response's start and one chunk went out
            raise OSError("the client left")

    async def receive():
        await asyncio.sleep(3600)  # no disconnect message: the failed send is the only sign

    async def serve():
        with pytest.raises(OSError):
            await ClosingStream(events(), media_type="text/event-stream")(SCOPE, receive, send)
        return list(closed)  # before asyncio.run closes what was left open

    assert asyncio.run(serve()) == [3], "the events were left suspended after the client left"
