"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health and Prometheus /metrics, on FastAPI + uvicorn.

The server tokenizes, detokenizes, streams and answers HTTP; the engine runs in a process
of its own (:mod:`specdec.serving.async_engine`), so its steps never wait on this process's GIL,
and a fault that kills it costs the requests in flight a 500, never the server: /health
answers 503 until a new engine serves. Concurrent clients share the engine's continuous
batching. A bad request gets 400/422 with a message and never touches other requests; a
client that disconnects cancels its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
import uuid

import attrs
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from ..errors import RequestError, SpecdecError
from ..executor.metrics import RequestMetrics
from ..parallel import WorkerError
from ..sampling_params import SamplingParams
from .async_engine import AsyncEngine, EngineBusy, EngineUnavailable
from .metrics import ServerMetrics
from .openai_protocol import (
    ChatRequest,
    CompletionRequest,
    ErrorResponse,
    logprobs_json,
    nth_sample,
    sampling_params_of,
    sse_chunk,
    usage_json,
)


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


@attrs.frozen(kw_only=True)
class ServerOptions:
    """Who may use the server, and how much.

    Attributes:
        api_key: every ``/v1`` route answers only requests carrying ``Authorization:
            Bearer <api_key>``; others get OpenAI's 401. None: open.
        protect_all: ``/health`` and ``/metrics`` need the key too.
        max_body_bytes: a request body larger than this is refused (413).
        max_waiting: requests waiting for the engine beyond this are refused (429), so a
            burst cannot queue without bound.
        allowed_origins: origins a browser may call the server from (CORS); none by default.
        request_timeout: seconds after which an unfinished request is aborted (504, or an
            error event when streamed); None: no limit.
    """

    api_key: str | None = None
    protect_all: bool = False
    max_body_bytes: int = 4 * 2**20
    max_waiting: int = 512
    allowed_origins: tuple[str, ...] = ()
    request_timeout: float | None = None


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


def _error_json(status: int, message: str, code: str | None = None) -> JSONResponse:
    """An error in OpenAI's shape (the caller counts the request in /metrics)."""
    error = {"message": message, "type": "invalid_request_error" if status < 500 else "server_error"}
    if code is not None:
        error["code"] = code
    return JSONResponse(status_code=status, content={"error": error})


def _error_schema(description: str) -> dict:
    return {"description": description, "model": ErrorResponse}


#: every status the API routes answer besides 200, as OpenAPI documents them
API_ERRORS = {
    400: _error_schema("the request cannot be served as asked: the message says what to change"),
    401: _error_schema("missing or wrong API key (servers started with --api-key)"),
    413: _error_schema("the body is larger than --max-body-bytes"),
    422: _error_schema("the body is not a valid request: the message names each field at fault"),
    429: _error_schema("more requests are waiting than --max-waiting allows: retry later"),
    499: _error_schema("the client disconnected before the answer was ready"),
    500: _error_schema("a request failed in the engine, or the engine process died while it ran"),
    503: _error_schema("the engine cannot serve now: it is restarting after a fault, or a tensor-parallel "
                       "worker is gone"),
    504: _error_schema("the request ran past --request-timeout and was aborted"),
}


def create_app(engine, options: ServerOptions | None = None) -> FastAPI:
    """The app serving ``engine``: an :class:`AsyncEngine`, or an ``LLM`` of this process
    (run on a thread: tests, notebooks). The app shuts the engine down when it stops."""
    if not isinstance(engine, AsyncEngine):
        engine = AsyncEngine.start_thread(engine)
    options = options or ServerOptions()
    info, codec = engine.info, engine.codec
    stats = ServerMetrics()
    model_name = info.model_name

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        """The API key where it is required, then the body size."""
        path = request.url.path
        key = options.api_key
        if key is not None and (path.startswith("/v1") or (options.protect_all and path in ("/health", "/metrics"))):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
                return _error_response(401, "missing or wrong API key: send the server's key as "
                                            "'Authorization: Bearer KEY'", code="invalid_api_key")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > options.max_body_bytes:
            return _error_response(413, f"the request body has {size} bytes; this server takes at most "
                                        f"{options.max_body_bytes} (specdec serve --max-body-bytes)")
        return await call_next(request)

    if options.allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(SpecdecError)
    async def specdec_error(_request, exc: SpecdecError):
        """The caller's input: 400; an engine that cannot serve now: 503; a fault: 500."""
        status = (503 if isinstance(exc, (WorkerError, EngineUnavailable)) else
                  400 if isinstance(exc, RequestError) or type(exc) is not SpecdecError else 500)
        return _error_response(status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, exc: RequestValidationError):
        """422 in OpenAI's error shape, which the ``openai`` client shows (FastAPI's own
        ``detail`` list reached its users as a bare "Error code: 422")."""
        problems = []
        for e in exc.errors():
            field = ".".join(str(part) for part in e["loc"] if part != "body")
            message = e["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
            problems.append(f"{field}: {message}" if field else message)
        return _error_response(422, "; ".join(problems))

    def _error_response(status: int, message: str, code: str | None = None) -> JSONResponse:
        """A refused request in OpenAI's error shape, counted in /metrics."""
        stats.requests.labels("error").inc()
        return _error_json(status, message, code)

    open_errors = {401: API_ERRORS[401]} if options.protect_all else {}

    @app.get("/health", responses={**open_errors, 503: API_ERRORS[503]})
    async def health():
        """``ok`` with the engine's configuration as it resolved it (the library's own
        resolution: quantization, compile, batch invariance, threads), or 503 saying why not."""
        try:
            await engine.call("health")
        except (WorkerError, EngineUnavailable) as exc:
            return _error_response(503, str(exc), "unhealthy")
        return {"status": "ok", "engine": info.resolved, "engine_restarts": engine.restarts}

    @app.get("/v1/models", responses={401: API_ERRORS[401]})
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdec",
                                            "created": 0, "max_model_len": info.max_model_len}]}

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        200: {"description": "Prometheus's text exposition format", "content": {"text/plain": {}}}, **open_errors})
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        try:
            engine_stats = await engine.call("stats")
        except SpecdecError:  # restarting: the server's own counters still answer
            engine_stats = None
        return Response(stats.render(engine_stats, engine.restarts), media_type=CONTENT_TYPE_LATEST)

    def check_max_tokens(prompts: list[list[int]], max_tokens: int | None) -> None:
        """An explicit ``max_tokens`` past what the context leaves after a prompt is refused
        naming the lengths (a default one is capped; a prompt the context cannot hold at all
        is the engine's own refusal)."""
        if max_tokens is None:
            return
        for ids in prompts:
            room = info.max_model_len - len(ids)
            if 0 < room < max_tokens:
                raise RequestError(f"max_tokens is {max_tokens} but the prompt has {len(ids)} tokens and the "
                                   f"model's context holds {info.max_model_len}: at most {room} can be generated; "
                                   "lower max_tokens or shorten the prompt")

    async def run(http: HTTPRequest, prompts: list[list[int]], params: SamplingParams, n: int, chat: bool,
                  stream: bool, echoes: list[str | list[int]] | None = None):
        """One response: ``n`` choices of each prompt (OpenAI's order: prompt by prompt), each
        choice a request of its own in the engine's batch; ``echoes``: per prompt as given
        (text or token ids), what is put before its choices' text (the completions API's
        ``echo``), with its tokens' logprobs if asked."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        items = [(ids, nth_sample(params, j)) for ids in prompts for j in range(n)]
        if echoes is not None:
            echoes = [p if isinstance(p, str) else codec.decode(ids) for p, ids in zip(echoes, prompts)]
        try:  # all or none: a bad prompt is a 400 before any is queued
            handles = await engine.submit(items, max_waiting=options.max_waiting)
        except EngineBusy as exc:
            return _error_response(429, f"{exc} (specdec serve --max-waiting)")
        updates = _within(_merged([engine.updates(h) for h in handles]), options.request_timeout)
        finals: dict[int, tuple] = {}  # choice index -> (request handle, its latest update)
        logprobs: list[list] = [[] for _ in items]  # per choice, its tokens' logprobs not yet sent
        echoed = [echoes[i // n] if echoes else "" for i in range(len(items))]

        def add_update(i, update):
            if i not in finals and params.prompt_logprobs is not None:  # nothing predicts the first token
                logprobs[i].append({handles[i].first_token: None})
            finals[i] = (handles[i], update)
            logprobs[i] += update.new_prompt_logprobs
            logprobs[i] += update.new_logprobs

        def take_logprobs(i, offset=0):
            """The logprobs JSON of choice ``i``'s tokens not sent yet (None if not asked)."""
            if params.logprobs is None:
                return None
            sent, logprobs[i] = logprobs[i], []
            return logprobs_json(sent, params.logprobs, chat, codec.token_text, offset)

        def finish(update, outcome="ok"):
            stats.finish(update.metrics or RequestMetrics(), update.num_output_tokens, outcome)

        def abandon():
            for _req, update in finals.values():
                if not update.finished:
                    finish(update, "aborted")

        timed_out = (f"the request ran for more than {options.request_timeout} s and was aborted "
                     "(specdec serve --request-timeout); ask for fewer tokens")
        if not stream:
            try:
                async for i, update in updates:
                    add_update(i, update)
                    if update.finished:
                        finish(update, "error" if update.error else "ok")
                    elif await http.is_disconnected():
                        await updates.aclose()
                        abandon()
                        return JSONResponse(status_code=499, content={"error": {"message": "client disconnected"}})
            except _TimedOut:
                abandon()
                return _error_json(504, timed_out, code="timeout")
            results = [finals[i] for i in range(len(items))]
            failed = [update for _, update in results if update.error]
            if failed:
                return _error_json(400 if all(u.bad_request for u in failed) else 500, failed[0].error)
            choices = []
            for i, (_req, update) in enumerate(results):
                choice = ({"index": i, "message": {"role": "assistant", "content": update.text}} if chat
                          else {"index": i, "text": echoed[i] + update.text})
                choice["logprobs"] = take_logprobs(i)
                choice["finish_reason"] = update.finish_reason
                choices.append(choice)
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                    "usage": usage_json(results, n)}

        def chunk(i, text, finish_reason, usage=None, logprobs=None) -> str:
            return sse_chunk(rid, f"{kind}.chunk" if chat else kind, created, model_name, i, text, finish_reason, chat,
                             usage, logprobs)

        async def events():
            shown = [""] * len(items)
            offsets = [0] * len(items)  # the legacy logprobs' text_offset of each choice's next token
            if chat:
                for i in range(len(items)):
                    yield chunk(i, {"role": "assistant", "content": ""}, None)
            try:
                async for i, update in updates:
                    add_update(i, update)
                    text = echoed[i] + update.text
                    if len(text) > len(shown[i]) and not text.endswith("\ufffd"):
                        sent = take_logprobs(i, offsets[i])
                        offsets[i] += sum(len(t) for t in sent["tokens"]) if sent and not chat else 0
                        yield chunk(i, text[len(shown[i]):], None, logprobs=sent)
                        shown[i] = text
                    if update.finished and update.error:  # the stream ends with the error, in OpenAI's shape
                        finish(update, "error")
                        error_type = "invalid_request_error" if update.bad_request else "server_error"
                        yield f"data: {json.dumps({'error': {'message': update.error, 'type': error_type}})}\n\n"
                        return
                    if update.finished:
                        finish(update, "ok")
                        last = len(finals) == len(items) and all(u.finished for _, u in finals.values())
                        usage = usage_json([finals[j] for j in range(len(items))], n) if last else None
                        yield chunk(i, "", update.finish_reason, usage,
                                    logprobs=take_logprobs(i, offsets[i]) if logprobs[i] else None)
            except _TimedOut:  # its unfinished choices are counted aborted below
                error = {"message": timed_out, "type": "invalid_request_error", "code": "timeout"}
                yield f"data: {json.dumps({'error': error})}\n\n"
            else:
                yield "data: [DONE]\n\n"
            finally:  # the client went away mid-stream: its unfinished choices are aborted
                await updates.aclose()
                abandon()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions", responses=API_ERRORS)
    async def completions(body: CompletionRequest, http: HTTPRequest):
        prompts = [codec.encode(prompt) for prompt in body.prompts()]
        check_max_tokens(prompts, body.max_tokens)
        return await run(http, prompts, sampling_params_of(body, info.sampling), body.n, False, body.stream,
                         body.prompts() if body.echo else None)

    @app.post("/v1/chat/completions", responses=API_ERRORS)
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        ids = codec.apply_chat_template([m.model_dump() for m in body.messages])
        check_max_tokens([ids], body.max_tokens)
        return await run(http, [ids], sampling_params_of(body, info.sampling), body.n, True, body.stream)

    return app


def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000,
          options: ServerOptions | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, options), host=host, port=port, log_level="info")
