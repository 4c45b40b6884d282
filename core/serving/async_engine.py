"""The engine behind asyncio callers (the server): in a process of its own, or on a thread.

The engine side (:class:`EngineLoop`) owns the engine and talks over one connection: it
takes commands (add requests, abort one, answer a call) between steps, runs a step while
requests are unfinished, and sends each step's updates as one message. The caller side
(:class:`AsyncEngine`) sends commands from the event loop and reads the connection on a
thread of its own, handing each request's updates to that request's asyncio queue, and
turns token ids into text there: detokenization never delays a step.

In a process of its own (:meth:`AsyncEngine.start_process`, what ``specdec serve`` runs)
the engine steps on that process's main thread, whose thread pool is the one torch's
kernels were tuned on, and nothing in the server shares its interpreter. A fault that
kills the process (a native library's abort, the kernel's OOM killer) ends the requests in
flight with an error naming it; the caller starts a new engine process, and meanwhile
new requests and ``health`` answer :class:`EngineUnavailable`.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import multiprocessing
import signal
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from multiprocessing.connection import Connection
from pathlib import Path

import attrs

from ..errors import RequestError, SpecdecError
from ..executor.metrics import RequestMetrics
from ..process_exit import exit_now
from ..sampling_params import SamplingParams
from ..text_codec import TextCodec

log = logging.getLogger(__name__)


class EngineUnavailable(SpecdecError):
    """The engine cannot take requests now (its process died and a new one is starting)."""


class EngineBusy(SpecdecError):
    """More requests are waiting for the engine than the caller allows: retry later."""


@attrs.define
class Update:
    """New tokens of a request, or its end (``finished``), or its failure (``error``;
    ``bad_request``: caused by the request's own input, such as a grammar llguidance gave
    up on, not by the engine). ``text`` is the output so far (cut at a stop string), filled
    in on the caller's side; ``num_output_tokens``; the log-probabilities of the new tokens
    where the request asks for them (``new_logprobs``, as ``RequestOutput.logprobs`` holds
    them) and of newly scored prompt tokens (``new_prompt_logprobs``); on the last update
    ``finish_reason`` and the request's ``metrics``."""

    new_token_ids: list[int]
    finished: bool = False
    error: str | None = None
    text: str = ""
    num_output_tokens: int = 0
    finish_reason: str | None = None
    metrics: RequestMetrics | None = None
    new_logprobs: list[dict[int, float]] = attrs.Factory(list)
    new_prompt_logprobs: list[dict[int, float]] = attrs.Factory(list)
    bad_request: bool = False
    stop_text: str | None = None


@attrs.frozen
class RequestHandle:
    """What a caller holds of a request it submitted: its id, its prompt's length and first
    token (an echoed prompt's first logprob entry), and on the caller's side the queue its
    updates arrive on. The handle holds the queue so that a request that finishes before
    its caller starts reading (one token, a fast engine) still has its updates to read."""

    request_id: str
    prompt_len: int
    first_token: int
    queue: asyncio.Queue | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class EngineInfo:
    """What the caller side needs to know of the engine: the model's name, its context, its
    vocabulary, where its tokenizer lives, the default sampling parameters, how many requests
    run at once, and the configuration as the engine resolved it (quantization, compile,
    batch invariance, threads: the library's own resolution)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer_path: str | None
    sampling: SamplingParams
    max_batch_size: int
    resolved: dict


def engine_info(llm) -> EngineInfo:
    import torch

    engine = llm.engine
    return EngineInfo(model_name=llm.target.name, max_model_len=engine.max_model_len,
                      vocab_size=llm.target.vocab_size, tokenizer_path=llm.tokenizer_path,
                      sampling=llm.config.sampling, max_batch_size=llm.config.engine.max_batch_size,
                      resolved={"quantization": llm.config.engine.quantization, "compile": engine.compiled,
                                "batch_invariant": engine.batch_invariant, "num_threads": torch.get_num_threads(),
                                "dtype": str(llm.dtype).removeprefix("torch."), "device": str(llm.device),
                                "decoding_type": engine.spec.decoding_type if engine.spec else None})


def engine_stats(engine) -> dict:
    """The engine's counters and gauges, as /metrics reports them."""
    totals, pool, windows = engine.totals, engine.kv.pool, engine.kv.windows
    graphs = engine.cuda_graphs
    return {"draft_tokens": totals.num_draft_tokens, "accepted_tokens": totals.num_accepted_tokens,
            "target_steps": totals.num_steps, "preemptions": engine.scheduler.num_preemptions,
            "speculation_off_steps": totals.num_steps_speculation_off, "drafter_faults": totals.num_drafter_faults,
            "decoding_type": engine.spec.decoding_type if engine.spec else "none",
            "draft_len_counts": list(totals.draft_len_counts), "acceptance_length": totals.acceptance_length,
            "per_position_acceptance": list(totals.per_position_acceptance),
            "queue_depth": len(engine.scheduler.waiting), "running_requests": len(engine.scheduler.running),
            "kv_cache_usage": pool.usage(), "kv_cache_blocks": pool.num_blocks,
            "kv_window_usage": windows.usage() if windows else 0.0,
            "kv_window_blocks": windows.num_blocks if windows else 0,
            "prefix_cache_queried_tokens": engine.kv.prefix_queried_tokens,
            "prefix_cache_hit_tokens": engine.kv.prefix_hit_tokens,
            "cuda_graphs": None if graphs is None else {"replayed": graphs.replays, "eager": graphs.eager_steps,
                                                        "graphs": graphs.num_graphs}}


# -- the engine side --------------------------------------------------------------------

class EngineLoop:
    """Serves one connection: commands between steps, a step while requests are unfinished.

    Commands: ``("add", call, [(token_ids, params), ...], max_waiting)`` checks every
    request, then adds them all or none (none either when more than ``max_waiting`` would
    wait), answering ``("reply", call, error, handles)``; ``("abort", id)``;
    ``("call", call, name)`` answers ``stats`` or ``health``; ``("stop",)``. A step's
    updates go out as ``("updates", [(id, Update), ...])``."""

    def __init__(self, llm, conn: Connection):
        self.llm, self.engine, self.conn = llm, llm.engine, conn
        self._prompt_sent: dict[str, int] = {}  # request id -> prompt logprobs sent

    def run(self) -> None:
        try:
            while True:
                if not self.engine.has_unfinished():
                    if not self._handle(self.conn.recv()):
                        return
                while self.conn.poll():
                    if not self._handle(self.conn.recv()):
                        return
                if self.engine.has_unfinished():
                    self._step()
        except (EOFError, OSError):  # the caller is gone: nothing to serve
            return
        finally:
            self.conn.close()

    def _reply(self, call: int, error: tuple[str, str] | None, value=None) -> None:
        self.conn.send(("reply", call, error, value))

    def _handle(self, command: tuple) -> bool:
        kind = command[0]
        if kind == "add":
            _, call, items, max_waiting = command
            waiting = len(self.engine.scheduler.waiting)
            if max_waiting is not None and waiting + len(items) > max_waiting:
                self._reply(call, ("busy", f"{waiting} requests are waiting and these add {len(items)}; at most "
                                           f"{max_waiting} may wait: retry later"))
                return True
            try:
                for token_ids, params in items:  # all first: a bad one leaves none queued
                    self.engine.check_request(token_ids, params)
                reqs = [self.engine.add_request(token_ids, params) for token_ids, params in items]
            except Exception as exc:  # noqa: BLE001 - that caller's error, never the engine's
                self._reply(call, _error_of(exc))
                return True
            self._reply(call, None, [RequestHandle(r.request_id, r.prompt_len, r.token_ids[0]) for r in reqs])
        elif kind == "abort":
            req = self.engine.requests.get(command[1])
            if req is not None and not req.finished:
                self.engine.abort(command[1])
                self.conn.send(("updates", [(req.request_id, self._update(req, []))]))
        elif kind == "call":
            _, call, name = command
            try:
                if name == "health":
                    self.engine.target.check_healthy()
                    value = "ok"
                else:
                    value = engine_stats(self.engine)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self._reply(call, _error_of(exc))
                return True
            self._reply(call, None, value)
        elif kind == "stop":
            return False
        return True

    def _update(self, req, new_token_ids: list[int], error: str | None = None) -> Update:
        finished = req.finished
        sent = self._prompt_sent.get(req.request_id, 0)
        prompt_logprobs = req.prompt_logprobs[sent:]
        self._prompt_sent[req.request_id] = len(req.prompt_logprobs)
        if finished:
            del self._prompt_sent[req.request_id]
        logprobs = req.output_logprobs[len(req.output_logprobs) - len(new_token_ids):] if new_token_ids else []
        return Update(list(new_token_ids), finished, error or req.error, num_output_tokens=req.num_output_tokens,
                      finish_reason=req.finish_reason if finished else None,
                      metrics=copy.deepcopy(req.metrics) if finished else None, new_logprobs=logprobs,
                      new_prompt_logprobs=prompt_logprobs, bad_request=error is None and req.error is not None,
                      stop_text=req.stop_text if finished else None)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failed step fails its requests, never the engine
            log.exception("engine step failed")
            failed = []
            for req in list(self.engine.requests.values()):
                if req.finished:
                    continue
                req.error = f"{type(exc).__name__}: {exc}"
                self.engine.abort(req.request_id)
                req.finish_reason = "error"
                failed.append((req.request_id, self._update(req, [], error=req.error)))
            self.conn.send(("updates", failed))
            return
        self.conn.send(("updates", [(out.request.request_id, self._update(out.request, out.new_token_ids))
                                    for out in outputs]))


def _error_of(exc: Exception) -> tuple[str, str]:
    """An exception as (kind, message) that crosses a process boundary: ``request`` (the
    caller's input), ``unavailable`` (a tensor-parallel worker gone) or ``internal``
    (``busy`` is the engine loop's own)."""
    from ..parallel import WorkerError

    kind = "unavailable" if isinstance(exc, WorkerError) else "request" if isinstance(exc, RequestError) \
        else "internal"
    return kind, str(exc) if kind != "internal" else f"{type(exc).__name__}: {exc}"


def _raise(error: tuple[str, str]) -> None:
    from ..parallel import WorkerError

    kind, message = error
    raise {"request": RequestError, "unavailable": WorkerError, "internal": SpecdecError, "busy": EngineBusy}.get(
        kind, EngineUnavailable)(message)


def _engine_process_main(conn: Connection, config, seed: int) -> None:
    """The engine process: build the engine as ``LLM()`` does, say so, serve the connection;
    once it is closed, the process ends at once (the server waits for it)."""
    from ..api import LLM

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the server, which stops this process
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s engine: %(message)s")
    try:
        llm = LLM(config=config, seed=seed)
    except BaseException as exc:  # noqa: BLE001 - told to the server, which cannot serve without it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    conn.send(("ready", engine_info(llm)))
    try:
        EngineLoop(llm, conn).run()
    finally:
        llm.close()
    exit_now(0)


# -- the caller side --------------------------------------------------------------------

class AsyncEngine:
    """The engine as asyncio callers see it: :meth:`submit` requests, read their
    :meth:`updates`, :meth:`call` for stats and health.

    Build it with :meth:`start_process` (the engine in a process of its own, restarted when
    it dies) or :meth:`start_thread` (an ``LLM`` of this process, on a thread)."""

    def __init__(self, info: EngineInfo, codec: TextCodec):
        self.info = info
        self.codec = codec
        self._conn: Connection | None = None
        self._send_lock = threading.Lock()
        self._calls = itertools.count()
        self._pending: dict[int, tuple[Future, asyncio.AbstractEventLoop | None, list[asyncio.Queue]]] = {}
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue, list[int]]] = {}
        self._lock = threading.Lock()  # guards _pending and _streams between the reader and the callers
        self._closing = False
        self._unavailable: str | None = None  # why new requests are refused now
        self._process: multiprocessing.process.BaseProcess | None = None
        self._start_args: tuple | None = None
        #: engine processes started after the first one died
        self.restarts = 0

    @classmethod
    def start_process(cls, config, seed: int = 0, start_timeout: float = 3600.0) -> AsyncEngine:
        """The engine of ``config`` in a new process (spawned: it builds its own torch
        state); returns once it has loaded its model."""
        conn, process, info = _spawn(config, seed, start_timeout)
        from ..model.loading import load_tokenizer

        tokenizer = load_tokenizer(Path(info.tokenizer_path)) if info.tokenizer_path else None
        engine = cls(info, TextCodec(tokenizer))
        engine._process, engine._start_args = process, (config, seed, start_timeout)
        engine._connect(conn)
        return engine

    @classmethod
    def start_thread(cls, llm) -> AsyncEngine:
        """``llm``'s engine on a thread of this process (tests, notebooks)."""
        ours, theirs = multiprocessing.Pipe()
        engine = cls(engine_info(llm), llm.codec)
        threading.Thread(target=EngineLoop(llm, theirs).run, name="specdec-engine", daemon=True).start()
        engine._connect(ours)
        return engine

    def _connect(self, conn: Connection) -> None:
        self._conn = conn
        self._unavailable = None
        threading.Thread(target=self._read, args=(conn,), name="specdec-engine-reader", daemon=True).start()

    # -- callers (the event loop) ---------------------------------------------------------

    def _send(self, message: tuple) -> None:
        if self._unavailable is not None:
            raise EngineUnavailable(self._unavailable)
        with self._send_lock:
            try:
                self._conn.send(message)
            except (OSError, ValueError) as exc:
                raise EngineUnavailable(f"the engine is not reachable ({exc}); retry shortly") from None

    async def submit(self, items: list[tuple[list[int], SamplingParams]],
                     max_waiting: int | None = None) -> list[RequestHandle]:
        """Queue requests, all or none: a RequestError (naming what is wrong with one of
        them) leaves none queued, and so does :class:`EngineBusy` when more than
        ``max_waiting`` requests would wait for the engine."""
        loop = asyncio.get_running_loop()
        call, future = next(self._calls), Future()
        queues = [asyncio.Queue() for _ in items]
        with self._lock:
            self._pending[call] = (future, loop, queues)
        try:
            self._send(("add", call, [(list(ids), params) for ids, params in items], max_waiting))
        except EngineUnavailable:
            with self._lock:
                self._pending.pop(call, None)
            raise
        handles = await asyncio.wrap_future(future)
        return [attrs.evolve(handle, queue=updates) for handle, updates in zip(handles, queues)]

    async def updates(self, handle: RequestHandle) -> AsyncIterator[Update]:
        """A submitted request's updates until it finishes; leaving early aborts it."""
        finished = False
        try:
            while not finished:
                update = await handle.queue.get()
                finished = update.finished
                yield update
        finally:
            if not finished:
                self.abort(handle.request_id)

    async def generate(self, token_ids: list[int], params: SamplingParams) -> AsyncIterator[tuple[RequestHandle,
                                                                                                   Update]]:
        """One request's updates, with its handle."""
        (handle,) = await self.submit([(token_ids, params)])
        async for update in self.updates(handle):
            yield handle, update

    def abort(self, request_id: str) -> None:
        try:
            self._send(("abort", request_id))
        except EngineUnavailable:
            pass  # its engine is gone, and the request with it

    async def call(self, name: str, timeout: float = 30.0):
        """``stats`` (the engine's counters) or ``health`` (raises if it cannot serve)."""
        call, future = next(self._calls), Future()
        with self._lock:
            self._pending[call] = (future, None, [])
        try:
            self._send(("call", call, name))
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"the engine did not answer within {timeout:.0f} s") from None
        finally:
            with self._lock:
                self._pending.pop(call, None)

    def shutdown(self) -> None:
        self._closing = True
        if self._conn is not None:
            try:
                with self._send_lock:
                    self._conn.send(("stop",))
            except (OSError, ValueError):
                pass
        if self._process is not None:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()

    # -- the reader thread ----------------------------------------------------------------

    def _read(self, conn: Connection) -> None:
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "updates":
                for request_id, update in message[1]:
                    self._deliver(request_id, update)
            elif kind == "reply":
                self._answer(*message[1:])
        self._engine_gone(conn)

    def _answer(self, call: int, error, value) -> None:
        with self._lock:
            future, loop, queues = self._pending.pop(call, (None, None, None))
            if future is None:
                return
            if error is None and queues:
                for handle, updates in zip(value, queues):
                    self._streams[handle.request_id] = (loop, updates, [])
        if not future.set_running_or_notify_cancel():  # the caller went away before the answer
            for handle in value if error is None and queues else []:
                self.abort(handle.request_id)
            return
        if error is None:
            future.set_result(value)
        else:
            try:
                _raise(error)
            except SpecdecError as exc:
                future.set_exception(exc)

    def _deliver(self, request_id: str, update: Update) -> None:
        with self._lock:
            target = self._streams.get(request_id)
            if target is not None and update.finished:
                del self._streams[request_id]
        if target is None:
            return
        loop, updates, output = target
        output += update.new_token_ids
        update.text = update.stop_text if update.stop_text is not None else self.codec.decode(output)
        loop.call_soon_threadsafe(updates.put_nowait, update)

    def _engine_gone(self, conn: Connection) -> None:
        """The connection closed: fail what was in flight; a dead engine process is replaced."""
        if self._closing:
            return
        process = self._process
        if process is not None:
            process.join(timeout=5)
            code = process.exitcode
            cause = (f"killed by signal {signal.Signals(-code).name}" if code is not None and code < 0
                     else f"exited with code {code}")
        else:
            cause = "its thread stopped"
        reason = f"the engine process {cause}; requests in flight were lost and a new engine is starting"
        log.error("%s", reason)
        self._unavailable = "the engine is restarting after a fault: retry shortly"
        with self._lock:
            pending, self._pending = self._pending, {}
            streams, self._streams = self._streams, {}
        for future, _, _ in pending.values():
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(reason))
        for loop, updates, _ in streams.values():
            loop.call_soon_threadsafe(updates.put_nowait, Update([], finished=True, error=reason,
                                                                 finish_reason="error"))
        conn.close()
        if self._start_args is None:
            return
        try:
            new_conn, self._process, _ = _spawn(*self._start_args)
        except Exception as exc:  # noqa: BLE001 - the server stays up and says why it cannot serve
            self._unavailable = f"the engine could not be restarted: {exc}"
            log.error("%s", self._unavailable)
            return
        self.restarts += 1
        log.info("a new engine process serves (restart %d)", self.restarts)
        self._connect(new_conn)

    @property
    def unavailable(self) -> str | None:
        """Why the engine takes no requests now (None: it does)."""
        return self._unavailable


def _spawn(config, seed: int, start_timeout: float):
    """Start an engine process and wait for it to load its model: (connection, process, info)."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    # not a daemon: a tensor-parallel engine starts worker processes of its own; it exits
    # when this end of the connection closes
    process = context.Process(target=_engine_process_main, args=(theirs, config, seed), name="specdec-engine")
    process.start()
    theirs.close()
    if not ours.poll(start_timeout):
        process.kill()
        raise SpecdecError(f"the engine process did not load its model within {start_timeout:.0f} s")
    try:
        kind, payload = ours.recv()
    except EOFError:
        process.join(timeout=5)
        raise SpecdecError(f"the engine process exited with code {process.exitcode} while loading its model "
                           "(see its log above)") from None
    if kind != "ready":
        process.join(timeout=30)
        raise SpecdecError(f"the engine could not start: {payload}")
    return ours, process, payload
