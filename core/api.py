"""The Python API: ``LLM`` and its outputs."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Iterator, Sequence

import attrs
import torch
from tqdm import tqdm

from .config import EngineConfig, SpecdecConfig
from .config_loading import config_from_dict, load_config, merge_overrides, unstructure
from .errors import RequestError
from .executor.engine import Engine
from .executor.metrics import RequestMetrics
from .kernels import prepack_linears
from .model.kept import keep_target, kept_target, reuse_key
from .model.loading import (
    gguf_file,
    load_tokenizer,
    load_weights,
    model_display_name,
    read_model_config,
    resolve_device,
    resolve_dtype,
    resolve_model_dir,
)
from .model.quantization import quantize_linears_w8a8
from .model.target import TargetModel
from .numerics.auto import resolve_draft_quantization, resolve_quantization
from .parallel import ShardedTarget, TensorParallelGroup, check_divides, run_worker, shard_model, threads_per_rank
from .plugins import drafter_plugin_manager, get_registry
from .sampling_params import SamplingParams
from .text_codec import TextCodec

log = logging.getLogger(__name__)

@attrs.define
class CompletionOutput:
    """vLLM's view of a request's one completion (``RequestOutput.outputs[0]``)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None


@attrs.define
class RequestOutput:
    """One finished request: ``text`` and ``token_ids`` hold the generated part only."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    logprobs: list[dict[int, float]] | None = None
    """With ``SamplingParams.logprobs``: per generated token, {token id: log-probability}, the
    generated token first, then the most likely tokens at its position."""
    prompt_logprobs: list[dict[int, float] | None] | None = None
    """With ``SamplingParams.prompt_logprobs``: the same per prompt token (None for the first)."""

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completion as vLLM's ``RequestOutput.outputs`` holds it, so code written for
        vLLM (``out.outputs[0].text``) runs unchanged."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.logprobs)]


class LLM:
    """A target model, optionally with a drafting method, ready to generate.

    ``LLM()`` loads the embedded SmolLM2-135M-Instruct without speculation;
    ``LLM(model=..., speculative_config={"decoding_type": "ngram", "max_draft_len": 4})``
    speculates with the named method (its plugin must be installed).
    """

    def __init__(self, model: str | None = None, *, tokenizer: str | None = None,
                 speculative_config: dict | None = None, dtype: str = "auto", device: str = "auto",
                 engine: dict | EngineConfig | None = None, sampling: dict | SamplingParams | None = None,
                 seed: int = 0, config: SpecdecConfig | None = None, tensor_parallel_size: int | None = None):
        if config is None:
            engine = unstructure(engine) if isinstance(engine, EngineConfig) else dict(engine or {})
            if tensor_parallel_size is not None:
                engine["tensor_parallel_size"] = tensor_parallel_size
            data = {"model": model, "tokenizer": tokenizer, "dtype": dtype, "device": device,
                    "speculative_config": speculative_config, "engine": engine,
                    "sampling": unstructure(sampling) if isinstance(sampling, SamplingParams) else (sampling or {})}
            config = config_from_dict(data)
        elif tensor_parallel_size is not None:
            config = attrs.evolve(config, engine=attrs.evolve(config.engine, tensor_parallel_size=tensor_parallel_size))
        tp = config.engine.tensor_parallel_size
        if tp > 1 or config.engine.num_threads:
            torch.set_num_threads(threads_per_rank(config))
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype)
        quantization = resolve_quantization(config.engine.quantization, config.dtype, self.device,
                                            gguf_file(config.model), tp)
        draft_quantization = resolve_draft_quantization(config.engine.draft_quantization, quantization,
                                                        self.device)
        config = attrs.evolve(config, engine=attrs.evolve(config.engine, quantization=quantization,
                                                          draft_quantization=draft_quantization))
        self.config = config
        # Resolve the method before loading weights, so that a missing plugin, or one
        # without a drafter yet, fails fast.
        registry = get_registry()
        spec = config.speculative_config
        if spec is not None:
            registry.resolve_drafter(spec.decoding_type)
        #: the tensor-parallel group this rank 0 leads (None at tensor_parallel_size 1)
        self.group = None
        if tp > 1:
            check_divides(read_model_config(config.model), tp)
            self.group = TensorParallelGroup.start(config, self.device)
            weakref.finalize(self, self.group.close)
        if self.group is not None and self.group.rank != 0:  # a worker of a torchrun launch
            try:
                run_worker(config, self.group, self.dtype)
            finally:
                self.group.close()
            raise SystemExit(0)
        try:
            self._load(config, spec, registry, seed)
        except BaseException:
            self.close()
            raise

    def _load(self, config: SpecdecConfig, spec, registry, seed: int) -> None:
        key = reuse_key(config, self.dtype, self.device)
        self.target = kept_target(key) or self._load_target(config)
        keep_target(key, self.target)
        self.tokenizer = self.target.tokenizer
        tok_path = resolve_model_dir(config.tokenizer) if config.tokenizer else self.target.path
        #: where the tokenizer was loaded from (a server's other process loads it from there)
        self.tokenizer_path = str(tok_path) if self.tokenizer is not None else None
        self.codec = TextCodec(self.tokenizer)
        hooks = self.drafter = None
        if spec is not None:
            self.drafter = registry.create_drafter(spec, self.target)
            lookup = registry.create_drafter(spec.lookup, self.target) if spec.lookup is not None else None
            for layer in self._drafters_own_linears(self.drafter, lookup):
                if config.engine.draft_quantization == "w8a8":
                    quantize_linears_w8a8(layer)
                if config.engine.prepack_weights:
                    prepack_linears(layer)
            hooks = drafter_plugin_manager(self.drafter, spec.decoding_type, lookup)
        self.engine = Engine(self.target, config.engine, spec, hooks, seed=seed)
        resolved = attrs.evolve(config.engine, compile=self.engine.compiled,
                                batch_invariant=self.engine.batch_invariant)
        keep_target(reuse_key(attrs.evolve(config, engine=resolved), self.dtype, self.device), self.target)

    def _drafters_own_linears(self, *drafters) -> list[torch.nn.Module]:
        """The linear layers of the ``drafters``' modules that are not the target's: a
        layer-skip draft runs the target's own layers, and a drafter may hold the target's
        head; their forwards are the target's to choose (other LLMs may share it)."""
        modules = [m for d in drafters if hasattr(d, "draft_modules") for m in d.draft_modules()]
        targets = {id(m) for m in self.target.model.modules()}
        return [m for module in modules for m in module.modules()
                if isinstance(m, torch.nn.Linear) and id(m) not in targets]

    def _load_target(self, config: SpecdecConfig) -> TargetModel:
        model_obj, path = load_weights(config.model, config.engine.quantization, self.dtype,
                                       self.group.device if self.group is not None else self.device)
        tokenizer = load_tokenizer(resolve_model_dir(config.tokenizer) if config.tokenizer else path)
        name = model_display_name(config.model, path)
        if self.group is None:
            return TargetModel(model_obj, tokenizer, name, max_model_len=config.engine.max_model_len, path=path)
        shard_model(model_obj, 0, self.group.size, self.group)
        self.group.loaded()
        return ShardedTarget(model_obj, tokenizer, name, self.group, max_model_len=config.engine.max_model_len,
                             path=path)

    def close(self) -> None:
        """Stop the tensor-parallel workers and leave their group (nothing at size 1);
        called at exit too. The LLM cannot generate afterwards."""
        if getattr(self, "group", None) is not None:
            self.group.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @classmethod
    def from_config(cls, path: str | os.PathLike, **overrides) -> LLM:
        """Build from a YAML file; ``overrides`` are dotted paths (``engine.max_batch_size=4``)."""
        config = load_config(path)
        if overrides:
            config = merge_overrides(config, {k.replace("__", "."): v for k, v in overrides.items()})
        return cls(config=config)

    # -- prompts ----------------------------------------------------------------------

    def get_tokenizer(self):
        """The target's tokenizer (None for a model given without one), as vLLM's ``LLM`` has it."""
        return self.tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.codec.encode(prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.codec.decode(token_ids)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation with the assistant's turn opened (:class:`TextCodec`)."""
        return self.codec.apply_chat_template(messages)

    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, Sequence) and prompts
                                                 and isinstance(prompts[0], int)):
            return [prompts]
        return list(prompts)

    # -- generation -------------------------------------------------------------------

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Generate for one prompt or many (strings, token-id lists, or vLLM's prompt dicts),
        batched continuously; ``sampling_params`` is one for all prompts or, as in vLLM, a
        sequence of one per prompt; ``use_tqdm`` shows finished requests on a progress bar
        (stderr)."""
        prompts = [_unwrapped(p) for p in self._as_list(prompts)]
        params = self._params_per_prompt(sampling_params, len(prompts))
        encoded = [self.encode(p) for p in prompts]
        for ids, sp in zip(encoded, params):  # all first: a bad prompt must not leave the good ones queued
            self.engine.check_request(ids, sp)
        reqs = [(p, self.engine.add_request(ids, sp)) for p, ids, sp in zip(prompts, encoded, params)]
        with tqdm(total=len(reqs), desc="requests", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(out.finished for out in self.engine.step()))
        return [self._output(p, r) for p, r in reqs]

    def _params_per_prompt(self, sampling_params, num_prompts: int) -> list[SamplingParams]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or self.config.sampling] * num_prompts
        if not isinstance(sampling_params, Sequence) or not all(isinstance(p, SamplingParams) for p in sampling_params):
            raise RequestError(f"sampling_params: expected a SamplingParams, or a list of them (one per prompt); "
                               f"got a {type(sampling_params).__name__}"
                               + (" of other things" if isinstance(sampling_params, Sequence) else ""))
        if len(sampling_params) != num_prompts:
            raise RequestError(f"sampling_params: {len(sampling_params)} given for {num_prompts} prompts; give one "
                               "per prompt, or a single SamplingParams for all of them")
        return list(sampling_params)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        """Reply to one conversation (a list of {role, content}) or to several (``sampling_params``
        and ``use_tqdm`` as in :meth:`generate`)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self.generate([self.apply_chat_template(c) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces of one request as its tokens are accepted; ``last_output`` holds the result."""
        params = sampling_params or self.config.sampling
        req = self.engine.add_request(self.encode(prompt), params)
        shown = ""
        while not req.finished:
            self.engine.step()
            text = self.output_text(req)
            if text.endswith("\ufffd") and not req.finished:
                continue  # an incomplete UTF-8 sequence: wait for the next token
            if len(text) > len(shown) and text.startswith(shown):
                yield text[len(shown):]
                shown = text
        self.last_output = self._output(prompt, req)

    def output_text(self, req) -> str:
        """A request's text so far: cut before the stop string that ended it, if one did."""
        return req.stop_text if req.stop_text is not None else self.decode(req.output_token_ids)

    def _output(self, prompt, req) -> RequestOutput:
        if req.finish_reason == "error":
            raise RequestError(req.error or "the request failed")
        text = self.output_text(req)
        return RequestOutput(request_id=req.request_id, prompt=prompt if isinstance(prompt, str) else None,
                             prompt_token_ids=req.token_ids[:req.prompt_len], text=text,
                             token_ids=list(req.output_token_ids), finish_reason=req.finish_reason,
                             metrics=req.metrics,
                             logprobs=None if req.sampling_params.logprobs is None else list(req.output_logprobs),
                             prompt_logprobs=None if req.sampling_params.prompt_logprobs is None
                             else [None, *req.prompt_logprobs])


def _unwrapped(prompt):
    """A prompt given in vLLM's forms, ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``,
    as the string or token ids it holds; any other prompt as it is."""
    if isinstance(prompt, dict) and len(prompt) == 1 and ("prompt" in prompt or "prompt_token_ids" in prompt):
        (prompt,) = prompt.values()
    return prompt

