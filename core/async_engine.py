"""The engine on a thread of its own, fed by asyncio callers (the server).

The engine is not thread-safe, so every call to it happens on its thread: callers post
commands (add, abort) to a queue, and the thread alternates between draining that queue
and running steps, publishing each request's new tokens to that request's asyncio queue.
Concurrent clients thereby share the engine's continuous batching. What a caller may read
of a request (its text so far, how it ended, its metrics) travels in the update as a
snapshot taken on the engine thread: the request object itself keeps changing there.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future

import attrs

from .api import LLM
from .executor.metrics import RequestMetrics
from .executor.request import Request
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


@attrs.define
class Update:
    """New tokens of a request, or its end (``finished``), or its failure (``error``;
    ``bad_request``: caused by the request's own input, such as a grammar llguidance gave
    up on, not by the engine), with snapshots taken on the engine thread: ``text`` (the
    output so far, cut at a stop string), ``num_output_tokens``, the log-probabilities of
    the new tokens where the request asks for them (``new_logprobs``, as
    ``RequestOutput.logprobs`` holds them), and on the last update ``finish_reason`` and a
    copy of the request's ``metrics``."""

    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    new_logprobs: list[dict[int, float]] = attrs.Factory(list)
    bad_request: bool = False


class AsyncEngine:
    def __init__(self, llm: LLM):
        self.llm = llm
        self.engine = llm.engine
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-engine", daemon=True)
        self._thread.start()

    # -- caller side (any thread, usually the event loop) -------------------------------

    async def generate(self, token_ids: list[int], params: SamplingParams) -> AsyncIterator[tuple[Request, Update]]:
        """Submit a request and yield its updates; leaving the loop early aborts it."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue = asyncio.Queue()
        added: Future = Future()
        self._commands.put(("add", token_ids, params, loop, updates, added))
        req: Request | None = None
        try:
            req = await asyncio.wrap_future(added)  # raises RequestError for a bad request
            while True:
                update = await updates.get()
                yield req, update
                if update.finished:
                    return
        finally:
            if req is None:  # cancelled while the engine thread was adding it (or refused)
                added.add_done_callback(self._abort_added)
            elif not req.finished:
                self.abort(req.request_id)

    def _abort_added(self, added: Future) -> None:
        if not added.cancelled() and added.exception() is None:
            self.abort(added.result().request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake",))
        self._thread.join(timeout=10)

    # -- engine thread --------------------------------------------------------------------

    def _publish(self, request_id: str, update: Update) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, updates = target
        loop.call_soon_threadsafe(updates.put_nowait, update)
        if update.finished:
            del self._streams[request_id]

    def _snapshot(self, req: Request, new_token_ids: list[int], error: str | None = None) -> Update:
        finished = req.finished
        logprobs = req.output_logprobs[len(req.output_logprobs) - len(new_token_ids):] if new_token_ids else []
        return Update(list(new_token_ids), finished, error or req.error, text=self.llm.output_text(req),
                      num_output_tokens=req.num_output_tokens, finish_reason=req.finish_reason if finished else None,
                      metrics=copy.deepcopy(req.metrics) if finished else None, new_logprobs=logprobs,
                      bad_request=error is None and req.error is not None)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, token_ids, params, loop, updates, added = command
            if not added.set_running_or_notify_cancel():
                return  # the caller went away before its request was added: add nothing
            try:
                req = self.engine.add_request(token_ids, params)
            except Exception as exc:  # reported to that caller only
                added.set_exception(exc)
                return
            self._streams[req.request_id] = (loop, updates)
            added.set_result(req)
        elif kind == "abort":
            req = self.engine.requests.get(command[1])
            self.engine.abort(command[1])
            self._publish(command[1], self._snapshot(req, []) if req is not None else Update([], finished=True))

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                command = self._commands.get(block=block)
                self._handle(command)
                while True:
                    self._handle(self._commands.get_nowait())
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails its requests, never the server
                log.exception("engine step failed")
                for req in list(self.engine.requests.values()):
                    req.error = f"{type(exc).__name__}: {exc}"
                    self.engine.abort(req.request_id)
                    req.finish_reason = "error"
                    self._publish(req.request_id, self._snapshot(req, [], error=req.error))
                continue
            for out in outputs:
                self._publish(out.request.request_id, self._snapshot(out.request, out.new_token_ids))
