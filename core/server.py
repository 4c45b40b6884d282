"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health and Prometheus /metrics, on FastAPI + uvicorn.

Concurrent clients share the engine's continuous batching (:mod:`specdec.async_engine`).
A bad request gets 400/422 with a message and never touches other requests; a client that
disconnects cancels its request, which frees its KV blocks.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from typing import Literal

import attrs
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from .api import LLM
from .async_engine import AsyncEngine
from .errors import SpecdecError
from .executor.metrics import RequestMetrics
from .sampling_params import SamplingParams


#: OpenAI request fields specdec does not implement, each with the values that leave it off.
#: Other values are refused (422), not ignored: the answer would not be what was asked for.
UNSUPPORTED_FIELDS = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                      "logprobs": (False, 0), "top_logprobs": (0,), "best_of": (1,), "tools": ([],),
                      "response_format": ({"type": "text"},), "echo": (False,), "suffix": ("",)}


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields (user, stream_options...) change no output

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: Literal[1] = 1

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value is not None and value not in UNSUPPORTED_FIELDS[name]:
                hint = " (repetition_penalty is the penalty specdec applies)" if name.endswith("_penalty") else ""
                raise ValueError(f"{name}={value!r} is not supported by specdec{hint}; leave it out")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict]  # a string or OpenAI's content parts; `LLM.apply_chat_template` reads both


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError(f"max_tokens={self.max_tokens} and max_completion_tokens="
                                 f"{self.max_completion_tokens} disagree; give one of them")
            self.max_tokens = self.max_completion_tokens
        return self


class _EngineCollector:
    """Speculation counters and engine gauges, read from the engine when /metrics is scraped
    (the engine keeps them; finished requests, aborted ones included)."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        engine, totals = self.engine, self.engine.totals
        pool = engine.kv.pool
        for name, doc, value in (("specdec_draft_tokens", "draft tokens proposed", totals.num_draft_tokens),
                                 ("specdec_accepted_tokens", "draft tokens accepted", totals.num_accepted_tokens),
                                 ("specdec_target_steps", "target forwards while decoding", totals.num_steps),
                                 ("specdec_preemptions", "running requests preempted for KV room",
                                  engine.scheduler.num_preemptions),
                                 ("specdec_speculation_off_steps",
                                  "decode steps the adaptive planner left without drafts (they would not pay)",
                                  totals.num_steps_speculation_off)):
            yield CounterMetricFamily(name, doc, value=value)
        faults = CounterMetricFamily("specdec_drafter_faults", "steps whose drafts a failing drafter cost",
                                     labels=["decoding_type"])
        faults.add_metric([engine.spec.decoding_type if engine.spec else "none"], totals.num_drafter_faults)
        yield faults
        depths = CounterMetricFamily("specdec_draft_len_steps", "decode steps by the depth of the draft verified",
                                     labels=["draft_len"])
        for depth, steps in enumerate(totals.draft_len_counts):
            depths.add_metric([str(depth)], steps)
        yield depths
        yield GaugeMetricFamily("specdec_acceptance_length", "mean tokens per target step, finished requests",
                                value=totals.acceptance_length)
        per_position = GaugeMetricFamily("specdec_per_position_acceptance", "acceptance rate by draft position",
                                         labels=["position"])
        for i, rate in enumerate(totals.per_position_acceptance):
            per_position.add_metric([str(i + 1)], rate)
        yield per_position
        for name, doc, value in (("specdec_queue_depth", "requests waiting", len(engine.scheduler.waiting)),
                                 ("specdec_running_requests", "requests running", len(engine.scheduler.running)),
                                 ("specdec_kv_cache_usage", "share of KV blocks in use", pool.usage()),
                                 ("specdec_kv_cache_blocks", "KV blocks in the pool", pool.num_blocks)):
            yield GaugeMetricFamily(name, doc, value=value)
        graphs = engine.cuda_graphs
        if graphs is not None:
            steps = CounterMetricFamily("specdec_cuda_graph_steps", "target forwards replayed from a CUDA graph, or "
                                        "run eagerly where no graph's bucket held the step", labels=["path"])
            steps.add_metric(["replayed"], graphs.replays)
            steps.add_metric(["eager"], graphs.eager_steps)
            yield steps
            yield GaugeMetricFamily("specdec_cuda_graphs", "CUDA graphs captured", value=graphs.num_graphs)


class ServerMetrics:
    """/metrics through prometheus_client: requests by outcome, tokens, histograms of each
    request's acceptance length, time to first token and time per output token, and the
    engine's speculation counters and gauges (:class:`_EngineCollector`)."""

    def __init__(self, engine):
        from prometheus_client import CollectorRegistry, Counter, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("specdec_requests", "requests by outcome", ["outcome"], registry=self.registry)
        for outcome in ("ok", "error", "aborted"):
            self.requests.labels(outcome)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "prompt tokens", registry=self.registry)
        self.generation_tokens = Counter("specdec_generation_tokens", "generated tokens", registry=self.registry)
        self.acceptance = Histogram("specdec_request_acceptance_length", "tokens per target step, per request",
                                    buckets=(1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0),
                                    registry=self.registry)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "time to first token", registry=self.registry)
        self.tpot = Histogram("specdec_time_per_output_token_seconds", "time per output token after the first",
                              buckets=(0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0),
                              registry=self.registry)
        self.registry.register(_EngineCollector(engine))

    def finish(self, metrics: RequestMetrics, completion_tokens: int, outcome: str) -> None:
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(metrics.num_prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if outcome != "ok":
            return
        if metrics.num_steps:
            self.acceptance.observe(metrics.acceptance_length)
        if metrics.time_to_first_token is not None:
            self.ttft.observe(metrics.time_to_first_token)
        if completion_tokens > 1 and metrics.finish_time and metrics.first_token_time:
            self.tpot.observe((metrics.finish_time - metrics.first_token_time) / (completion_tokens - 1))

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


def _params(body: _SamplingFields, defaults: SamplingParams) -> SamplingParams:
    given = {k: getattr(body, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty", "seed", "stop") if getattr(body, k) is not None}
    return attrs.evolve(defaults, **given)


def _usage(req, update) -> dict:
    """Usage from the final update's snapshot (``req`` only for its fixed prompt length)."""
    completion = update.num_output_tokens
    return {"prompt_tokens": req.prompt_len, "completion_tokens": completion,
            "total_tokens": req.prompt_len + completion, "speculative": update.metrics.as_dict()}


def create_app(llm: LLM) -> FastAPI:
    engine = AsyncEngine(llm)
    stats = ServerMetrics(llm.engine)
    model_name = llm.target.name

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(SpecdecError)
    async def specdec_error(_request, exc: SpecdecError):
        return _error_response(400, str(exc))

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

    def _error_response(status: int, message: str) -> JSONResponse:
        """A refused request in OpenAI's error shape, counted in /metrics."""
        stats.requests.labels("error").inc()
        return JSONResponse(status_code=status, content={"error": {"message": message,
                                                                   "type": "invalid_request_error"}})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdec",
                                            "created": 0}]}

    @app.get("/metrics")
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(stats.render(), media_type=CONTENT_TYPE_LATEST)

    async def run(http: HTTPRequest, token_ids: list[int], params: SamplingParams, chat: bool, stream: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        updates = engine.generate(token_ids, params)
        first = await updates.__anext__()  # raises RequestError (-> 400) before any byte is sent

        def finish(update, outcome="ok"):
            stats.finish(update.metrics or RequestMetrics(), update.num_output_tokens, outcome)

        if not stream:
            req, update = first
            while not update.finished:
                if await http.is_disconnected():
                    await updates.aclose()
                    finish(update, "aborted")
                    return JSONResponse(status_code=499, content={"error": {"message": "client disconnected"}})
                req, update = await updates.__anext__()
            if update.error:
                finish(update, "error")
                return JSONResponse(status_code=500, content={"error": {"message": update.error}})
            finish(update)
            choice = ({"index": 0, "message": {"role": "assistant", "content": update.text}} if chat
                      else {"index": 0, "text": update.text, "logprobs": None})
            choice["finish_reason"] = update.finish_reason
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                    "usage": _usage(req, update)}

        async def events():
            shown = ""
            req, update = first
            if chat:
                yield _sse(rid, "chat.completion.chunk", created, model_name, {"role": "assistant", "content": ""},
                           None, chat)
            try:
                while True:
                    text = update.text
                    if len(text) > len(shown) and not text.endswith("\ufffd"):
                        yield _sse(rid, f"{kind}.chunk" if chat else kind, created, model_name,
                                   text[len(shown):], None, chat)
                        shown = text
                    if update.finished:
                        break
                    req, update = await updates.__anext__()
                finish(update, "error" if update.error else "ok")
                yield _sse(rid, f"{kind}.chunk" if chat else kind, created, model_name, "", update.finish_reason,
                           chat, usage=_usage(req, update))
                yield "data: [DONE]\n\n"
            finally:
                if not update.finished:  # the client went away mid-stream
                    engine.abort(req.request_id)
                    finish(update, "aborted")

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await run(http, llm.encode(body.prompt), _params(body, llm.config.sampling), False, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        ids = llm.apply_chat_template([m.model_dump() for m in body.messages])
        return await run(http, ids, _params(body, llm.config.sampling), True, body.stream)

    return app


def _sse(rid, kind, created, model, text, finish_reason, chat, usage=None) -> str:
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(create_app(llm), host=host, port=port, log_level="info")
