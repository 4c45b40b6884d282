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

import contextlib
import secrets

import attrs
from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from ..errors import RequestError, SpecdecError
from ..parallel import WorkerError
from ..sampling_params import SamplingParams
from .answer import Answer, error_json
from .async_engine import AsyncEngine, EngineBusy, EngineUnavailable
from .metrics import ServerMetrics
from .openai_protocol import ChatRequest, CompletionRequest, ErrorResponse, nth_sample, sampling_params_of


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
    stats = ServerMetrics()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    def refuse(status: int, message: str, code: str | None = None) -> JSONResponse:
        """A refused request in OpenAI's error shape, counted in /metrics."""
        stats.requests.labels("error").inc()
        return error_json(status, message, code)

    _add_guards(app, options, refuse)
    _add_routes(app, engine, options, stats, refuse)
    return app


def _add_guards(app: FastAPI, options: ServerOptions, refuse) -> None:
    """The API key and body size checked before a route runs, CORS where configured, and
    every error a route raises answered in OpenAI's shape."""

    @app.middleware("http")
    async def guard(request: HTTPRequest, call_next):
        """The API key where it is required, then the body size."""
        path = request.url.path
        key = options.api_key
        if key is not None and (path.startswith("/v1") or (options.protect_all and path in ("/health", "/metrics"))):
            scheme, _, given = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(given.strip().encode(), key.encode()):
                return refuse(401, "missing or wrong API key: send the server's key as 'Authorization: Bearer KEY'",
                              code="invalid_api_key")
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > options.max_body_bytes:
            return refuse(413, f"the request body has {size} bytes; this server takes at most "
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
        return refuse(status, str(exc))

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, exc: RequestValidationError):
        """422 in OpenAI's error shape, which the ``openai`` client shows (FastAPI's own
        ``detail`` list reached its users as a bare "Error code: 422")."""
        problems = []
        for e in exc.errors():
            field = ".".join(str(part) for part in e["loc"] if part != "body")
            message = e["msg"].removeprefix("Value error, ")  # a validator's own message says what is wrong
            problems.append(f"{field}: {message}" if field else message)
        return refuse(422, "; ".join(problems))


def _add_routes(app: FastAPI, engine: AsyncEngine, options: ServerOptions, stats: ServerMetrics, refuse) -> None:
    """/health, /v1/models, /metrics and the two completion APIs."""
    info, codec, model_name = engine.info, engine.codec, engine.info.model_name
    open_errors = {401: API_ERRORS[401]} if options.protect_all else {}

    @app.get("/health", responses={**open_errors, 503: API_ERRORS[503]})
    async def health():
        """``ok`` with the engine's configuration as it resolved it (the library's own
        resolution: quantization, compile, batch invariance, threads), or 503 saying why not."""
        try:
            await engine.call("health")
        except (WorkerError, EngineUnavailable) as exc:
            return refuse(503, str(exc), "unhealthy")
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

    async def answer(http: HTTPRequest, prompts: list[list[int]], params: SamplingParams, n: int, chat: bool,
                     stream: bool, echoes: list[str | list[int]] | None = None):
        """``n`` choices of each prompt, each a request of its own in the engine's batch;
        ``echoes``: per prompt as given (text or token ids), what is put before its
        choices' text (the completions API's ``echo``)."""
        items = [(ids, nth_sample(params, j)) for ids in prompts for j in range(n)]
        try:  # all or none: a bad prompt is a 400 before any is queued
            handles = await engine.submit(items, max_waiting=options.max_waiting)
        except EngineBusy as exc:
            return refuse(429, f"{exc} (specdec serve --max-waiting)")
        echoed = [p if isinstance(p, str) else codec.decode(ids) for p, ids in zip(echoes, prompts)] if echoes else []
        reply = Answer(engine, handles, params, n, chat, model_name=model_name, stats=stats,
                       echoed=[echoed[i // n] if echoed else "" for i in range(len(items))],
                       timeout=options.request_timeout)
        return reply.streamed() if stream else await reply.whole(http)

    @app.post("/v1/completions", responses=API_ERRORS)
    async def completions(body: CompletionRequest, http: HTTPRequest):
        prompts = [codec.encode(prompt) for prompt in body.prompts()]
        check_max_tokens(prompts, body.max_tokens)
        return await answer(http, prompts, sampling_params_of(body, info.sampling), body.n, False, body.stream,
                            body.prompts() if body.echo else None)

    @app.post("/v1/chat/completions", responses=API_ERRORS)
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        ids = codec.apply_chat_template([m.model_dump() for m in body.messages])
        check_max_tokens([ids], body.max_tokens)
        return await answer(http, [ids], sampling_params_of(body, info.sampling), body.n, True, body.stream)


def serve(engine: AsyncEngine, host: str = "127.0.0.1", port: int = 8000,
          options: ServerOptions | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(engine, options), host=host, port=port, log_level="info")
