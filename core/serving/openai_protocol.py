"""The OpenAI API's side of the server: request bodies as pydantic models (what is
accepted, what is refused and why), and responses, usage, log-probabilities and stream
chunks in OpenAI's JSON shapes."""

from __future__ import annotations

import json
from typing import Any, Literal

import attrs
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from ..executor.metrics import RequestMetrics
from ..sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

#: choices of one response (prompts x n): each is a request in the engine's batch
MAX_CHOICES = 64
#: OpenAI request fields specdec does not implement, each with the values that leave it off.
#: Other values are refused (422), not ignored: the answer would not be what was asked for.
UNSUPPORTED_FIELDS = {"best_of": (1,), "tools": ([],), "suffix": ("",)}
#: vLLM's older names of the ``structured_outputs`` fields
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}


class ErrorBody(BaseModel):
    message: str
    type: str
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, which every refused request gets."""

    error: ErrorBody


class JsonSchemaFormat(BaseModel):
    """OpenAI's ``response_format.json_schema``: the schema the output follows."""

    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("give json_schema exactly when type is 'json_schema'")
        return self


class StructuredOutputsFields(BaseModel):
    """vLLM's ``structured_outputs``: one of a JSON schema, any JSON object, a regex, a
    choice of strings, or a Lark/GBNF grammar."""

    model_config = ConfigDict(extra="forbid")

    json_: dict | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")  # other fields (user, stream_options...) change no output

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias in [-100, 100]
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's: no EOS or stop token before this many
    seed: int | None = None
    stop: str | list[str] | None = None
    extra_args: dict[str, Any] | None = None  # options for drafting plugins (vLLM's): never change output
    stream: bool = False
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _structure: StructuredOutputs | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _one_structure(self):
        """The grammar asked for, as :class:`StructuredOutputs` (a FieldError if malformed)."""
        given = [name for name in ("structured_outputs", *GUIDED_FIELDS) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)} each ask for structured output; give one of them")
        if self.structured_outputs is not None:
            fields = self.structured_outputs.model_dump(by_alias=True, exclude_none=True)
            self._structure = StructuredOutputs(**{k: v for k, v in fields.items() if k != "json_object" or v})
        elif given and given[0] in GUIDED_FIELDS:
            self._structure = StructuredOutputs(**{GUIDED_FIELDS[given[0]]: getattr(self, given[0])})
        elif given:
            fmt = self.response_format
            self._structure = (StructuredOutputs(json_object=True) if fmt.type == "json_object"
                               else StructuredOutputs(json=fmt.json_schema.schema_))
        return self

    def structure_asked(self) -> StructuredOutputs | None:
        return self._structure

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED_FIELDS and value is not None and value not in UNSUPPORTED_FIELDS[name]:
                raise ValueError(f"{name}={value!r} is not supported by specdec; leave it out")
        return self


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: the prompt alone (scored with echo and logprobs)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # top tokens a position (legacy form)
    echo: bool = False  # the prompt before each choice's text (and its tokens' logprobs, if asked)

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_asked(self) -> int | None:
        return self.logprobs if self.echo else None

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

    def prompt_logprobs_asked(self) -> None:
        return None

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


def sampling_params_of(body: CompletionRequest | ChatRequest, defaults: SamplingParams) -> SamplingParams:
    """The request's sampling parameters: the server's defaults with what the body sets."""
    given = {k: getattr(body, k) for k in ("max_tokens", "temperature", "top_p", "top_k", "min_p",
                                           "repetition_penalty", "frequency_penalty", "presence_penalty",
                                           "logit_bias", "min_tokens", "seed", "stop", "extra_args")
             if getattr(body, k) is not None}
    return attrs.evolve(defaults, **given, logprobs=body.logprobs_asked(),
                        prompt_logprobs=body.prompt_logprobs_asked(), structured_outputs=body.structure_asked())


def logprobs_json(entries: list[dict[int, float]], num_top: int, chat: bool, decode, offset: int = 0) -> dict:
    """Tokens' log-probabilities (``RequestOutput.logprobs`` entries; ``{token: None}`` for an
    echoed prompt's first token, which nothing predicts) in OpenAI's form: chat's ``content``
    list, or the completions API's legacy columns with ``text_offset`` counted from ``offset``."""
    rows = []
    for entry in entries:
        (token, logprob), *_ = entry.items()
        top = None if logprob is None else sorted(entry.items(), key=lambda item: -item[1])[:num_top]
        rows.append((decode([token]), logprob, top and [(decode([t]), v) for t, v in top]))
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
            "top_logprobs": [None if top is None else dict(top) for _, _, top in rows], "text_offset": offsets}


def usage_json(finals: list, n: int) -> dict:
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


def nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of a prompt's j-th choice: a given seed advances per choice, so ``n``
    seeded samples differ from each other."""
    return params if j == 0 or params.seed is None else attrs.evolve(params, seed=params.seed + j)


def sse_chunk(rid, kind, created, model, index, text, finish_reason, chat, usage=None, logprobs=None) -> str:
    """One server-sent event of a streamed response: choice ``index``'s new ``text`` (chat:
    a delta, or the opening role when ``text`` is a dict)."""
    if chat:
        delta = text if isinstance(text, dict) else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    chunk = {"id": rid, "object": kind, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"
