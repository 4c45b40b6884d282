"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health and Prometheus /metrics, on FastAPI + uvicorn.

Concurrent clients share the engine's continuous batching (:mod:`specdec.async_engine`).
A bad request gets 400/422 with a message and never touches other requests; a client that
disconnects cancels its request, which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
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
from .sampling_params import MAX_LOGPROBS, SamplingParams


MAX_CHOICES = 64  # choices of one response (prompts x n): each is a request in the engine's batch
#: OpenAI request fields specdec does not implement, each with the values that leave it off.
#: Other values are refused (422), not ignored: the answer would not be what was asked for.
UNSUPPORTED_FIELDS = {"frequency_penalty": (0,), "presence_penalty": (0,), "logit_bias": ({},),
                      "best_of": (1,), "tools": ([],), "response_format": ({"type": "text"},),
                      "echo": (False,), "suffix": ("",)}


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
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value is not None and value not in UNSUPPORTED_FIELDS[name]:
                hint = " (repetition_penalty is the penalty specdec applies)" if name.endswith("_penalty") else ""
                raise ValueError(f"{name}={value!r} is not supported by specdec{hint}; leave it out")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top tokens a position (legacy form)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    @model_validator(mode="after")
    def _at_most_max_choices(self):
        if len(self.prompts()) * self.n > MAX_CHOICES:
            raise ValueError(f"{len(self.prompts())} prompts x n={self.n} choices is more than {MAX_CHOICES}; "
                             "send fewer at once")
        return self

    def prompts(self) -> list:
        """The prompts of this request: one (a string or token ids) or a batch of them."""
        batch = isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int)
        return list(self.prompt) if batch else [self.prompt]


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict]  # a string or OpenAI's content parts; `LLM.apply_chat_template` reads both


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    def logprobs_asked(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

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


def _params(body: CompletionRequest | ChatRequest, defaults: SamplingParams) -> SamplingParams:
    given = {k: getattr(body, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty", "seed", "stop") if getattr(body, k) is not None}
    return attrs.evolve(defaults, **given, logprobs=body.logprobs_asked())


def _logprobs_json(entries: list[dict[int, float]], num_top: int, chat: bool, decode, offset: int = 0) -> dict:
    """Tokens' log-probabilities (``RequestOutput.logprobs`` entries) in OpenAI's form: chat's
    ``content`` list, or the completions API's legacy columns with ``text_offset`` counted
    from ``offset``."""
    rows = []
    for entry in entries:
        (token, logprob), *_ = entry.items()
        top = sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        rows.append((decode([token]), logprob, [(decode([t]), v) for t, v in top]))
    if chat:
        def piece(text, logprob):
            return {"token": text, "logprob": logprob, "bytes": None if "\ufffd" in text else list(text.encode())}
        return {"content": [{**piece(text, logprob), "top_logprobs": [piece(t, v) for t, v in top]}
                            for text, logprob, top in rows]}
    offsets = []
    for text, _, _ in rows:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": [text for text, _, _ in rows], "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [dict(top) for _, _, top in rows], "text_offset": offsets}


def _usage(finals: list, n: int) -> dict:
    """Usage of a response from its choices' final updates (``req`` only for its fixed prompt
    length; a prompt sampled ``n`` times counts once); ``speculative`` sums the choices'
    metrics, its time to first token the response's first."""
    prompt = sum(req.prompt_len for req, _ in finals[::n])
    completion = sum(update.num_output_tokens for _, update in finals)
    metrics = [update.metrics or RequestMetrics() for _, update in finals]
    total = metrics[0]
    if len(metrics) > 1:
        total = RequestMetrics(arrival_time=min(m.arrival_time for m in metrics))
        firsts = [m.first_token_time for m in metrics if m.first_token_time is not None]
        total.first_token_time = min(firsts) if firsts else None
        for m in metrics:
            total.merge(m)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "speculative": total.as_dict()}


def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of a prompt's j-th choice: a given seed advances per choice, so ``n``
    seeded samples differ from each other."""
    return params if j == 0 or params.seed is None else attrs.evolve(params, seed=params.seed + j)


async def _merged(streams: list):
    """(choice index, request, update) from several requests' update streams as they come;
    closing it cancels the streams, which aborts their unfinished requests."""
    arrivals: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for req, update in stream:
                arrivals.put_nowait((i, req, update))
        except Exception as exc:  # noqa: BLE001 - raised again to the consumer
            arrivals.put_nowait((i, None, exc))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, req, update = await arrivals.get()
            if isinstance(update, Exception):
                raise update
            yield i, req, update
            left -= update.finished
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def create_app(llm: LLM) -> FastAPI:
    engine = AsyncEngine(llm)
    stats = ServerMetrics(llm.engine)
    model_name = llm.target.name

    def token_text(ids: list[int]) -> str:
        return llm.tokenizer.decode(ids) if llm.tokenizer is not None else str(ids[0])

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

    async def run(http: HTTPRequest, prompts: list[list[int]], params: SamplingParams, n: int, chat: bool,
                  stream: bool):
        """One response: ``n`` choices of each prompt (OpenAI's order: prompt by prompt), each
        choice a request of its own in the engine's batch."""
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        items = [(ids, _nth_sample(params, j)) for ids in prompts for j in range(n)]
        for ids, item_params in items:  # all first: a bad prompt is a 400 before any is queued
            llm.engine.check_request(ids, item_params)
        updates = _merged([engine.generate(ids, item_params) for ids, item_params in items])
        finals: dict[int, tuple] = {}  # choice index -> (request, its latest update)
        logprobs: list[list] = [[] for _ in items]  # per choice, its tokens' logprobs not yet sent

        def logprobs_json(i, offset=0):
            if params.logprobs is None:
                return None
            sent, logprobs[i] = logprobs[i], []
            return _logprobs_json(sent, params.logprobs, chat, token_text, offset)

        def finish(update, outcome="ok"):
            stats.finish(update.metrics or RequestMetrics(), update.num_output_tokens, outcome)

        def abandon():
            for _req, update in finals.values():
                if not update.finished:
                    finish(update, "aborted")

        if not stream:
            async for i, req, update in updates:
                finals[i] = (req, update)
                logprobs[i] += update.new_logprobs
                if update.finished:
                    finish(update, "error" if update.error else "ok")
                elif await http.is_disconnected():
                    await updates.aclose()
                    abandon()
                    return JSONResponse(status_code=499, content={"error": {"message": "client disconnected"}})
            results = [finals[i] for i in range(len(items))]
            failed = [update.error for _, update in results if update.error]
            if failed:
                return JSONResponse(status_code=500, content={"error": {"message": failed[0]}})
            choices = []
            for i, (_req, update) in enumerate(results):
                choice = ({"index": i, "message": {"role": "assistant", "content": update.text}} if chat
                          else {"index": i, "text": update.text})
                choice["logprobs"] = logprobs_json(i)
                choice["finish_reason"] = update.finish_reason
                choices.append(choice)
            return {"id": rid, "object": kind, "created": created, "model": model_name, "choices": choices,
                    "usage": _usage(results, n)}

        chunk_kind = f"{kind}.chunk" if chat else kind

        async def events():
            shown = [""] * len(items)
            offsets = [0] * len(items)  # the legacy logprobs' text_offset of each choice's next token
            if chat:
                for i in range(len(items)):
                    yield _sse(rid, chunk_kind, created, model_name, i, {"role": "assistant", "content": ""},
                               None, chat)
            try:
                async for i, req, update in updates:
                    finals[i] = (req, update)
                    logprobs[i] += update.new_logprobs
                    text = update.text
                    if len(text) > len(shown[i]) and not text.endswith("\ufffd"):
                        sent = logprobs_json(i, offsets[i])
                        offsets[i] += sum(len(t) for t in sent["tokens"]) if sent and not chat else 0
                        yield _sse(rid, chunk_kind, created, model_name, i, text[len(shown[i]):], None, chat,
                                   logprobs=sent)
                        shown[i] = text
                    if update.finished:
                        finish(update, "error" if update.error else "ok")
                        last = len(finals) == len(items) and all(u.finished for _, u in finals.values())
                        usage = _usage([finals[j] for j in range(len(items))], n) if last else None
                        yield _sse(rid, chunk_kind, created, model_name, i, "", update.finish_reason, chat, usage,
                                   logprobs=logprobs_json(i, offsets[i]) if logprobs[i] else None)
                yield "data: [DONE]\n\n"
            finally:  # the client went away mid-stream: its unfinished choices are aborted
                await updates.aclose()
                abandon()

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        prompts = [llm.encode(prompt) for prompt in body.prompts()]
        return await run(http, prompts, _params(body, llm.config.sampling), body.n, False, body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HTTPRequest):
        ids = llm.apply_chat_template([m.model_dump() for m in body.messages])
        return await run(http, [ids], _params(body, llm.config.sampling), body.n, True, body.stream)

    return app


def _sse(rid, kind, created, model, index, text, finish_reason, chat, usage=None, logprobs=None) -> str:
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    uvicorn.run(create_app(llm), host=host, port=port, log_level="info")
