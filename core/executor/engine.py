"""The engine: continuous batching around the speculative step.

One call of :meth:`Engine.step` is one target forward for every scheduled request, in
stages, each a collaborator with one job::

    schedule   the scheduler picks prompt chunks and decodes within the token budget
    draft      the draft stage asks the planner how much each request may draft and the
               drafter's hooks for proposals; checks them, reserves KV, builds tree masks
    forward    one packed target forward over prompt chunks, roots and draft tokens
    verify     the verifier accepts a path of each draft and draws the next token
    output     the output processor appends the tokens, applies stop rules, logprobs
    commit     the KV cache keeps the accepted path (compacting a tree's), frees the rest;
               drafters get the hidden states of the kept tokens
    observe    metrics, the planner and the drafter learn from the step; finished
               requests leave
"""

from __future__ import annotations

import itertools
import logging
import time

import pluggy
import torch
from tqdm import tqdm

from ..config import EngineConfig, SpeculativeConfig
from ..drafting.interface import StepResult
from ..errors import FieldError, RequestError
from ..kernels import invariant_attention_is_kernel, paged_attention_is_triton
from ..kvcache import HiddenStateCache, KVCacheManager
from ..kvcache.layout import AttentionLayout, SequenceSlice
from ..model.target import ForwardMetadata, TargetModel
from ..numerics.auto import resolve_batch_invariant, resolve_compile
from ..plugins import proposal_callers
from ..sampler.grammar import GrammarCompiler
from ..sampling_params import SamplingParams
from .cuda_graphs import CudaGraphs
from .draft_stage import DraftStage
from .kv_budget import kv_cache_blocks
from .kv_commit import KVCommit
from .metrics import RequestMetrics
from .output_processor import OutputProcessor
from .packed_forward import PackedForward
from .planner import DraftPlanner
from .request import Request, Status
from .scheduler import Scheduler
from .step_items import StepItem, StepOutput
from .verifier import Verifier

log = logging.getLogger(__name__)


def _reads_prompt_hidden_states(hooks: pluggy.PluginManager) -> bool:
    """Whether some plugin asking for target hidden states reads them for every prompt
    token: the engine then keeps every committed token's states beside its K/V, so that a
    prefix served from the prefix cache comes with its states (see the hook's documentation)."""
    askers = {impl.plugin for impl in hooks.hook.target_hidden_layers.get_hookimpls()}
    declared = {impl.plugin for impl in hooks.hook.reads_prompt_hidden_states.get_hookimpls()}
    return not askers <= declared or any(hooks.hook.reads_prompt_hidden_states())


class Engine:
    def __init__(self, target: TargetModel, config: EngineConfig, spec: SpeculativeConfig | None = None,
                 hooks: pluggy.PluginManager | None = None, seed: int = 0):
        if config.cuda_graphs and target.device.type != "cuda":
            raise FieldError("engine.cuda_graphs", f"the target runs on {target.device.type}; CUDA graphs need a "
                                                   "CUDA device (device: cuda): set cuda_graphs: false")
        self.target = target
        self.config = config
        self.spec = spec
        self.hooks = hooks.hook if hooks is not None else None
        self.max_model_len = min(config.max_model_len or target.max_model_len, target.max_model_len)
        self.hidden_layers: list[int] = []
        if self.hooks is not None:
            wanted = self.hooks.target_hidden_layers(target=target)
            self.hidden_layers = sorted({layer for layers in wanted for layer in layers})
            target.capture_hidden_layers(self.hidden_layers)
        #: the layers whose states every target forward of this engine keeps
        self.state_layers = frozenset(self.hidden_layers)
        keep_states = bool(self.hidden_layers) and config.enable_prefix_caching and _reads_prompt_hidden_states(hooks)
        num_blocks, window_blocks = kv_cache_blocks(config, target, len(self.hidden_layers) if keep_states else 0,
                                                    self.max_model_len)
        cache = target.new_kv_cache(num_blocks, config.block_size, window_blocks)
        self.kv = KVCacheManager(cache, num_blocks, config.block_size, config.enable_prefix_caching)
        #: every committed token's hidden states, for requests whose prefix comes from the cache
        self.hidden_cache = (HiddenStateCache(self.hidden_layers, num_blocks * config.block_size, target.hidden_size,
                                              target.dtype, target.device) if keep_states else None)
        self.scheduler = Scheduler(config, self.kv)
        #: whether the target's forward is compiled, ``engine.compile`` resolved
        self.compiled = resolve_compile(config, target)
        #: the batch-invariant numerics mode, ``engine.batch_invariant`` resolved
        self.batch_invariant = resolve_batch_invariant(config, target, self.compiled)
        log.info("engine.batch_invariant: %s (%s); engine.compile: %s (%s)", "on" if self.batch_invariant else "off",
                 config.batch_invariant, "on" if self.compiled else "off", config.compile)
        target.set_linear_forwards(self.batch_invariant, config.prepack_weights and not self.compiled)
        if self.compiled:
            target.compile(self.batch_invariant)
            self._warm_up_compiled()
            if self.hooks is not None:
                self.hooks.compile_draft(target=target)
        # the torch attentions pad a batch's sequences to the widest, the kernels do not; the
        # batch-invariant torch attention also runs a step's draft trees as a batch of their own
        attention_is_kernel = (invariant_attention_is_kernel(target.device) if self.batch_invariant
                               else paged_attention_is_triton(target.device))
        #: every rule of how much each request drafts (None without speculation)
        self.planner = (DraftPlanner.for_config(spec, padded_attention=not attention_is_kernel,
                                                tree_batch=self.batch_invariant and not attention_is_kernel,
                                                min_rows=target.lone_token_rows)
                        if spec is not None else None)
        self.drafts = DraftStage(self.hooks, self.planner, self.kv, target.vocab_size, self.max_model_len,
                                 spec.decoding_type if spec is not None else "drafter",
                                 *(proposal_callers(hooks) if hooks is not None else ()))
        graphs = (CudaGraphs(target, cache, config.block_size, self.max_model_len, config.max_batch_size,
                             self.state_layers)
                  if config.cuda_graphs else None)
        self.forward = PackedForward(target, self.kv, self.batch_invariant, self.state_layers, graphs)
        self.grammars = GrammarCompiler(target.tokenizer, target.eos_token_ids)
        self.verifier = Verifier(target.eos_token_ids,
                                 spec.acceptance_rule(target.tokenizer) if spec is not None else None)
        self.outputs = OutputProcessor(target.eos_token_ids, target.tokenizer, self.max_model_len)
        self.kv_commit = KVCommit(self.kv, self.hidden_cache, target.device)
        self.requests: dict[str, Request] = {}
        self.totals = RequestMetrics()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)

    @property
    def _adaptive(self) -> bool:
        return self.planner is not None and self.planner.adaptive

    @property
    def cuda_graphs(self) -> CudaGraphs | None:
        """The target forward through CUDA graphs where a step fits one (``engine.cuda_graphs``)."""
        return self.forward.cuda_graphs

    @property
    def drafter_faults(self) -> dict[str, int]:
        """Drafter faults by kind (the requests' ``num_drafter_faults`` summed)."""
        return self.drafts.faults

    def _warm_up_compiled(self) -> None:
        """Compile the compiled target's graphs now, not on the first requests: one token of
        one sequence, two tokens of one, then, where the engine batches requests
        (``max_batch_size`` > 1), one token each of two sequences (a batch-invariant target has
        one graph for all: two tokens), written into the first blocks (no request holds any
        yet). A progress bar on a terminal: the first compilation takes a minute or two;
        torch's on-disk caches shorten the next."""
        started = time.perf_counter()
        blocks, size, device = self.kv.pool.num_blocks, self.kv.block_size, self.target.device
        first = list(range(min(2, blocks)))
        if self.batch_invariant:
            steps = [[(first, 2)]]
        else:
            batches = self.scheduler.config.max_batch_size > 1
            steps = [[(first, 1)], [(first, 2)]] + ([[([0], 1), ([1], 1)]] if batches else [])
        for step in tqdm(steps, desc="engine.compile: compiling the target's graphs", unit="graph", disable=None):
            if any(len(table) * size < count or max(table) >= blocks for table, count in step):
                continue
            layout = AttentionLayout([SequenceSlice(block_table=table, start=0,
                                                    positions=torch.arange(count, device=device))
                                      for table, count in step], size, device)
            tokens = layout.num_tokens
            self.target.forward(torch.zeros(tokens, dtype=torch.long, device=device), layout.query_positions,
                                ForwardMetadata(cache=self.kv.cache, layout=layout,
                                                hidden_layers=self.state_layers),
                                torch.tensor([tokens - 1], device=device))
        log.info("engine.compile: the target's graphs compiled in %.0f s", time.perf_counter() - started)

    # -- requests -------------------------------------------------------------------

    def add_request(self, token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> Request:
        """Queue a request; a RequestError if it can never be served (the engine is unaffected)."""
        self.check_request(token_ids, params)
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (), generator=self._seeds))
        generator = torch.Generator(device=self.target.device).manual_seed(seed)
        req = Request(request_id=request_id, token_ids=list(token_ids), prompt_len=len(token_ids),
                      sampling_params=params, generator=generator,
                      grammar=self.grammars.grammar(params.structured_outputs) if params.structured_outputs else None)
        req.metrics.arrival_time = time.perf_counter()
        req.metrics.num_prompt_tokens = len(token_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """A RequestError if the request can never be served; callers queuing several
        requests check them all first, so a bad one leaves none behind."""
        self.target.check_healthy()
        if not token_ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"(0..{self.target.vocab_size - 1})")
        bad = [t for t in list(params.logit_bias or {}) + list(params.stop_token_ids)
               if not 0 <= t < self.target.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} in logit_bias or stop_token_ids are outside the vocabulary "
                               f"(0..{self.target.vocab_size - 1})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len} "
                               "(prompt + at least one generated token); shorten the prompt or raise "
                               "engine.max_model_len up to the model's limit")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        self.kv.check_fits(longest)
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)  # a RequestError naming what llguidance refused

    def abort(self, request_id: str) -> None:
        """Cancel a request and free its KV blocks (no-op if it already ended)."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self._finish(req, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    def _finish(self, req: Request, reason: str) -> None:
        req.status = Status.FINISHED
        req.finish_reason = reason
        req.metrics.finish_time = time.perf_counter()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.totals.merge(req.metrics)
        if self.planner is not None:
            self.planner.forget(req)
        if self.hooks is not None:
            self.hooks.on_request_finished(request=req)

    # -- the step -------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        batch_size = len(self.scheduler.running) + min(len(self.scheduler.waiting), 1)
        plan = self.scheduler.schedule(draft_budget=self.drafts.draft_budget(batch_size))       # schedule
        if plan.empty:
            return []
        items = [StepItem.prefill(req, n) for req, n in plan.prefills]
        before_drafts = self.planner.step_shape(items, plan.decodes) if self._adaptive else None
        items += self.drafts.decode_items(plan.decodes, plan.draft_allowance,                    # draft
                                          len(self.scheduler.running), before_drafts)
        logits, hidden = self.forward(items)                                                      # forward
        results = self.verifier.verify(items, logits)                                             # verify
        outputs = self.outputs.process(items, results, logits)                                    # output
        self.kv_commit.commit(items, results, hidden)                                             # commit
        self._observe(items, results, outputs, started)                                          # observe
        return outputs

    def _observe(self, items: list[StepItem], results: list[StepResult], outputs: list[StepOutput],
                 started: float) -> None:
        """Metrics, the planner and the drafter learn from the step; finished requests leave.
        The planner learns the step's time without drafting (and without finishing requests,
        whose cost does not grow with the tokens a step verifies)."""
        for it, res, out in zip(items, results, outputs):
            if not it.is_prefill:
                depth = it.proposal.depth if it.proposal is not None else 0
                it.request.metrics.record_step(depth, it.num_nodes, len(res.accepted_nodes), len(out.new_token_ids))
        self.drafts.observe(results)
        if self.planner is not None:
            self.planner.observe_step(items, results, time.perf_counter() - started - self.drafts.seconds)
        for out in outputs:
            if out.finished:
                self._finish(out.request, out.request.finish_reason)
