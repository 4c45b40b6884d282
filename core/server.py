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
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field

from .api import LLM
from .async_engine import AsyncEngine
from .errors import SpecdecError
from .executor.metrics import RequestMetrics
from .sampling_params import SamplingParams


class _SamplingFields(BaseModel):
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


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)


class ServerMetrics:
    """Counters behind /metrics: requests by outcome and tokens here, speculation from the
    engine's own totals (every finished request, aborted ones included)."""

    def __init__(self):
        self.requests = {"ok": 0, "error": 0, "aborted": 0}
        self.prompt_tokens = 0
        self.completion_tokens = 0

    def finish(self, metrics: RequestMetrics, completion_tokens: int, outcome: str) -> None:
        self.requests[outcome] += 1
        self.prompt_tokens += metrics.num_prompt_tokens
        self.completion_tokens += completion_tokens

    def render(self, engine) -> str:
        pool, totals = engine.kv.pool, engine.totals
        lines = [
            "# TYPE specdec_requests_total counter",
            *(f'specdec_requests_total{{outcome="{k}"}} {v}' for k, v in self.requests.items()),
            "# TYPE specdec_prompt_tokens_total counter", f"specdec_prompt_tokens_total {self.prompt_tokens}",
            "# TYPE specdec_generation_tokens_total counter",
            f"specdec_generation_tokens_total {self.completion_tokens}",
            "# TYPE specdec_draft_tokens_total counter", f"specdec_draft_tokens_total {totals.num_draft_tokens}",
            "# TYPE specdec_accepted_tokens_total counter",
            f"specdec_accepted_tokens_total {totals.num_accepted_tokens}",
            "# TYPE specdec_target_steps_total counter", f"specdec_target_steps_total {totals.num_steps}",
            "# TYPE specdec_acceptance_length gauge", f"specdec_acceptance_length {totals.acceptance_length:.6f}",
            "# TYPE specdec_per_position_acceptance gauge",
            *(f'specdec_per_position_acceptance{{position="{i + 1}"}} {r:.6f}'
              for i, r in enumerate(totals.per_position_acceptance)),
            "# TYPE specdec_queue_depth gauge", f"specdec_queue_depth {len(engine.scheduler.waiting)}",
            "# TYPE specdec_running_requests gauge", f"specdec_running_requests {len(engine.scheduler.running)}",
            "# TYPE specdec_kv_cache_usage gauge", f"specdec_kv_cache_usage {pool.usage():.6f}",
            "# TYPE specdec_kv_cache_blocks gauge", f"specdec_kv_cache_blocks {pool.num_blocks}",
        ]
        return "\n".join(lines) + "\n"


def _params(body: _SamplingFields, defaults: SamplingParams) -> SamplingParams:
    given = {k: getattr(body, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty", "seed", "stop") if getattr(body, k) is not None}
    return attrs.evolve(defaults, **given)


def _usage(req, metrics: RequestMetrics) -> dict:
    completion = req.num_output_tokens
    return {"prompt_tokens": req.prompt_len, "completion_tokens": completion,
            "total_tokens": req.prompt_len + completion, "speculative": metrics.as_dict()}


def create_app(llm: LLM) -> FastAPI:
    engine = AsyncEngine(llm)
    stats = ServerMetrics()
    model_name = llm.target.name

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        engine.shutdown()

    app = FastAPI(title="specdec", version="0.1.0", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(SpecdecError)
    async def specdec_error(_request, exc: SpecdecError):
        stats.requests["error"] += 1
        return JSONResponse(status_code=400, content={"error": {"message": str(exc), "type": "invalid_request_error"}})

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specdec",
                                            "created": 0}]}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(stats.render(llm.engine))

    async def run(http: HTTPRequest, token_ids: list[int], params: SamplingParams, chat: bool, stream: bool):
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        updates = engine.generate(token_ids, params)
        first = await updates.__anext__()  # raises RequestError (-> 400) before any byte is sent

        def finish(req, outcome="ok"):
            stats.finish(req.metrics, req.num_output_tokens, outcome)

        if not stream:
            req, update = first
            while not update.finished:
                if await http.is_disconnected():
                    await updates.aclose()
                    finish(req, "aborted")
                    return JSONResponse(status_code=499, content={"error": {"message": "client disconnected"}})
                req, update = await updates.__anext__()
            if update.error:
                finish(req, "error")
                return JSONResponse(status_code=500, content={"error": {"message": update.error}})
            finish(req)
            text = llm.output_text(req)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                      else {"index": 0, "text": text, "logprobs": None})
            choice["finish_reason"] = req.finish_reason
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": [choice],
                    "usage": _usage(req, req.metrics)}

        async def events():
            shown = ""
            req, update = first
            if chat:
                yield _sse(rid, "chat.completion.chunk", created, model_name, {"role": "assistant", "content": ""},
                           None, chat)
            try:
                while True:
                    text = llm.output_text(req)
                    if len(text) > len(shown) and not text.endswith("\ufffd"):
                        yield _sse(rid, f"{kind}.chunk" if chat else kind, created, model_name,
                                   text[len(shown):], None, chat)
                        shown = text
                    if update.finished:
                        break
                    req, update = await updates.__anext__()
                finish(req, "error" if update.error else "ok")
                yield _sse(rid, f"{kind}.chunk" if chat else kind, created, model_name, "", req.finish_reason, chat,
                           usage=_usage(req, req.metrics))
                yield "data: [DONE]\n\n"
            finally:
                if not req.finished:  # the client went away mid-stream
                    engine.abort(req.request_id)
                    finish(req, "aborted")

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
