"""One API request's answer, built from the engine's updates: the ``n`` choices of each
prompt (OpenAI's order: prompt by prompt), each a request of its own in the engine's
batch, their updates merged as they come, answered whole or streamed as server-sent
events. A client that leaves, or a request past its time, aborts the unfinished choices
(closing their update streams frees their KV blocks) and counts them aborted in /metrics.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse

from ..executor.metrics import RequestMetrics
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .openai_protocol import logprobs_json, sse_chunk, usage_json


async def _merged(streams: list):
    """(choice index, update) from several requests' update streams as they come;
    closing it cancels the streams, which aborts their unfinished requests."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for update in stream:
                arrivals.put_nowait((i, update))
        except Exception as exc:  # noqa: BLE001 - raised again to the consumer
            arrivals.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, update = await arrivals.get()
            if isinstance(update, Exception):
                raise update
            yield i, update
            left -= update.finished
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _TimedOut(Exception):
    pass


async def _within(updates, seconds: float | None):
    """``updates`` until ``seconds`` have passed since the first was asked for; then
    :class:`_TimedOut`, ``updates`` closed (which aborts its requests)."""
    if seconds is None:
        async for update in updates:
            yield update
        return
    deadline = asyncio.get_running_loop().time() + seconds
    while True:
        try:
            update = await asyncio.wait_for(anext(updates), deadline - asyncio.get_running_loop().time())
        except StopAsyncIteration:
            return
        except asyncio.TimeoutError:
            await updates.aclose()
            raise _TimedOut from None
        yield update


def error_json(status: int, message: str, code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape (the caller counts the request in /metrics)."""
    error = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error"}
    if code is not None:
        error["code"] = code
    return JSONResponse(status_code=status, content={"error": error})


class ClosingStream(StreamingResponse):
    """A streamed response that closes its events when it ends however it ends. Starlette
    leaves them suspended when the client leaves while a chunk is being sent; their
    ``finally`` (abort the engine's requests, count them aborted) then waited for the
    garbage collector, and the engine kept decoding for nobody."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class Answer:
    """The choices of one request, submitted to the engine as ``handles`` (choice ``i`` of
    prompt ``i // n``); ``echoed``: per choice, the text put before its own (the
    completions API's ``echo``); ``timeout``: seconds before the unfinished choices are
    aborted (None: no limit)."""

    def __init__(self, engine: AsyncEngine, handles: list, params: SamplingParams, n: int, chat: bool, *,
                 model_name: str, stats: ServerMetrics, echoed: list[str], timeout: float | None):
        self.handles, self.params, self.n, self.chat = handles, params, n, chat
        self.model_name, self.stats, self.echoed, self.timeout = model_name, stats, echoed, timeout
        self.codec = engine.codec
        self.rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"
        self.updates = _within(_merged([engine.updates(h) for h in handles]), timeout)
        self.finals: dict[int, tuple] = {}  # choice index -> (request handle, its latest update)
        self.logprobs: list[list] = [[] for _ in handles]  # per choice, its tokens' logprobs not yet sent

    @property
    def timed_out(self) -> str:
        return (f"the request ran for more than {self.timeout} s and was aborted (specdec serve "
                "--request-timeout); ask for fewer tokens")

    def add(self, i: int, update) -> None:
        if i not in self.finals and self.params.prompt_logprobs is not None:  # nothing predicts the first token
            self.logprobs[i].append({self.handles[i].first_token: None})
        self.finals[i] = (self.handles[i], update)
        self.logprobs[i] += update.new_prompt_logprobs
        self.logprobs[i] += update.new_logprobs

    def take_logprobs(self, i: int, offset: int = 0):
        """The logprobs JSON of choice ``i``'s tokens not sent yet (None if not asked)."""
        if self.params.logprobs is None:
            return None
        sent, self.logprobs[i] = self.logprobs[i], []
        return logprobs_json(sent, self.params.logprobs, self.chat, self.codec.token_text, offset)

    def finish(self, update, outcome: str = "ok") -> None:
        self.stats.finish(update.metrics or RequestMetrics(), update.num_output_tokens, outcome)

    def abandon(self) -> None:
        for _request, update in self.finals.values():
            if not update.finished:
                self.finish(update, "aborted")

    def results(self) -> list[tuple]:
        return [self.finals[i] for i in range(len(self.handles))]

    async def whole(self, http: HTTPRequest):
        """The answer as one JSON body once every choice finished; 499 if the client left."""
        try:
            async for i, update in self.updates:
                self.add(i, update)
                if update.finished:
                    self.finish(update, "error" if update.error else "ok")
                elif await http.is_disconnected():
                    await self.updates.aclose()
                    self.abandon()
                    return JSONResponse(status_code=499, content={"error": {"message": "client disconnected"}})
        except _TimedOut:
            self.abandon()
            return error_json(504, self.timed_out, code="timeout")
        results = self.results()
        failed = [update for _, update in results if update.error]
        if failed:
            return error_json(400 if all(u.bad_request for u in failed) else 500, failed[0].error)
        choices = []
        for i, (_request, update) in enumerate(results):
            choice = ({"index": i, "message": {"role": "assistant", "content": update.text}} if self.chat
                      else {"index": i, "text": self.echoed[i] + update.text})
            choice["logprobs"] = self.take_logprobs(i)
            choice["finish_reason"] = update.finish_reason
            choices.append(choice)
        return {"id": self.rid, "object": self.kind, "created": self.created, "model": self.model_name,
                "choices": choices, "usage": usage_json(results, self.n)}

    def streamed(self) -> StreamingResponse:
        return ClosingStream(self._events(), media_type="text/event-stream")

    def _chunk(self, i: int, text, finish_reason, usage=None, logprobs=None) -> str:
        kind = f"{self.kind}.chunk" if self.chat else self.kind
        return sse_chunk(self.rid, kind, self.created, self.model_name, i, text, finish_reason, self.chat, usage,
                         logprobs)

    async def _events(self):
        count = len(self.handles)
        shown = [""] * count
        offsets = [0] * count  # the legacy logprobs' text_offset of each choice's next token
        if self.chat:
            for i in range(count):
                yield self._chunk(i, {"role": "assistant", "content": ""}, None)
        try:
            async for i, update in self.updates:
                self.add(i, update)
                text = self.echoed[i] + update.text
                if len(text) > len(shown[i]) and not text.endswith("\ufffd"):
                    sent = self.take_logprobs(i, offsets[i])
                    offsets[i] += sum(len(t) for t in sent["tokens"]) if sent and not self.chat else 0
                    yield self._chunk(i, text[len(shown[i]):], None, logprobs=sent)
                    shown[i] = text
                if update.finished and update.error:  # the stream ends with the error, in OpenAI's shape
                    self.finish(update, "error")
                    error_type = "invalid_request_error" if update.bad_request else "server_error"
                    yield f"data: {json.dumps({'error': {'message': update.error, 'type': error_type}})}\n\n"
                    return
                if update.finished:
                    self.finish(update, "ok")
                    last = len(self.finals) == count and all(u.finished for _, u in self.finals.values())
                    usage = usage_json(self.results(), self.n) if last else None
                    yield self._chunk(i, "", update.finish_reason, usage,
                                      logprobs=self.take_logprobs(i, offsets[i]) if self.logprobs[i] else None)
        except _TimedOut:  # its unfinished choices are counted aborted below
            error = {"message": self.timed_out, "type": "invalid_request_error", "code": "timeout"}
            yield f"data: {json.dumps({'error': error})}\n\n"
        else:
            yield "data: [DONE]\n\n"
        finally:  # the client went away mid-stream: its unfinished choices are aborted
            await self.updates.aclose()
            self.abandon()
