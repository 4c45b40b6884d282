"""The engine: continuous batching around the speculative step.

One call of :meth:`Engine.step` is one target forward for every scheduled request::

    scheduler.schedule  -> planner picks each request's draft depth (draft_planner.py)
      -> drafter hooks propose (prepare_draft_tokens) -> planner trims each proposal
      -> build_tree_mask  -> one packed target forward over prompt chunks and drafts
      -> sampler accepts a path and draws the bonus/correction token
      -> KV cache keeps the accepted path (compacts a tree path), frees the rest
      -> drafter hooks observe the result (on_draft_verified) -> stop conditions
      -> planner learns the step's cost and each request's acceptance
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from collections.abc import Sequence

import attrs
import pluggy
import torch

from ..config import EngineConfig, SpeculativeConfig
from ..drafting import DraftProposal, StepResult, TreeMask, proposal_problem, tree_mask_problem
from ..errors import FieldError, RequestError
from ..kernels import AttentionLayout, SequenceSlice, invariant_attention_is_kernel, paged_attention_is_triton
from ..kernels.invariant import mode_costs_nothing
from ..kvcache import HiddenStateCache, KVCacheManager, PagedKVCache
from ..sampler import (Verdict, apply_repetition_penalty, probs_from_logits, verify_greedy, verify_greedy_batch,
                       verify_sampled)
from ..sampling_params import SamplingParams
from .cuda_graphs import CudaGraphs
from .draft_planner import DraftPlanner, StepShape, attention_work
from .metrics import RequestMetrics
from .model_runner import ForwardMetadata, TargetModel
from .request import Request, Status
from .scheduler import Scheduler

log = logging.getLogger(__name__)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device the KV cache lives on (CUDA: the driver's; CPU: the OS's)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_batch_invariant(config: EngineConfig, target: TargetModel) -> bool:
    """``engine.batch_invariant`` as the engine runs it: ``auto`` is on for a bfloat16 CPU
    target, neither compiled nor quantized, whose every layer the mode runs as cheaply as
    stock numerics (:func:`specdec.kernels.invariant.mode_costs_nothing`), where it was
    measured to cost what stock numerics cost."""
    if config.batch_invariant != "auto":
        return config.batch_invariant
    return (target.device.type == "cpu" and target.dtype == torch.bfloat16 and not config.compile
            and config.quantization is None and mode_costs_nothing(target.model, target.layer_shapes))


@attrs.define
class StepOutput:
    """What one step changed for one request (for streaming)."""

    request: Request
    new_token_ids: list[int]
    finished: bool


@attrs.define
class _Item:
    """One request's share of the packed forward."""

    request: Request
    tokens: list[int]
    start: int  # position (and cache index) of the first token
    positions: torch.Tensor
    tree_mask: torch.Tensor | None  # [T, T] among the new tokens (None: causal)
    logits_from: int = 0  # first row of this item in the step's logits
    num_logits: int = 0
    prompt_rows: range = range(0)  # rows of a prefill chunk (from its first) whose prompt logprobs are asked
    prompt_logits_from: int = 0  # their first row in the step's logits, after every item's own
    row_offset: int = 0  # first row of this item in the packed tokens
    proposal: DraftProposal | None = None
    is_prefill: bool = False


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
        keep_states = bool(self.hidden_layers) and config.enable_prefix_caching and _reads_prompt_hidden_states(hooks)
        token_bytes = PagedKVCache.bytes_per_token(target.layer_shapes, target.dtype) + (
            HiddenStateCache.bytes_per_token(len(self.hidden_layers), target.hidden_size, target.dtype)
            if keep_states else 0)
        budget = (free_memory_bytes(target.device) * config.kv_cache_memory_fraction
                  if config.kv_cache_memory_fraction else config.kv_cache_memory_mb * 2**20)
        num_blocks = config.kv_cache_blocks or max(1, int(budget // (config.block_size * token_bytes)))
        cache = PagedKVCache(target.layer_shapes, num_blocks, config.block_size, target.dtype, target.device)
        self.kv = KVCacheManager(cache, num_blocks, config.block_size, config.enable_prefix_caching)
        #: every committed token's hidden states, for requests whose prefix comes from the cache
        self.hidden_cache = (HiddenStateCache(self.hidden_layers, num_blocks * config.block_size, target.hidden_size,
                                              target.dtype, target.device) if keep_states else None)
        self.scheduler = Scheduler(config, self.kv)
        self.acceptance_rule = spec.acceptance_rule(target.tokenizer) if spec is not None else None
        # the config is frozen: its draft shapes are worked out once per depth and batch size
        # (a Medusa tree's node count from its choice list took a millisecond a step at batch 8)
        self._nodes_for_depth = functools.cache(spec.nodes_for_depth) if spec is not None else None
        self._shape_for_batch = functools.cache(spec.draft_shape_for_batch) if spec is not None else None
        self.planner = (DraftPlanner(self._nodes_for_depth, spec.probe_interval, chain_or_tree=spec.chain_or_tree)
                        if spec is not None and spec.is_adaptive else None)
        #: the batch-invariant numerics mode, ``engine.batch_invariant`` resolved
        self.batch_invariant = resolve_batch_invariant(config, target)
        log.info("engine.batch_invariant: %s (%s)", "on" if self.batch_invariant else "off", config.batch_invariant)
        target.set_linear_forwards(self.batch_invariant, config.prepack_weights and not config.compile)
        if config.compile:
            target.compile()
            self._warm_up_compiled()
        # the torch attentions pad a batch's sequences to the widest, the kernels do not; the
        # batch-invariant torch attention also runs a step's draft trees as a batch of their own
        attention_is_kernel = (invariant_attention_is_kernel(target.device) if self.batch_invariant
                               else paged_attention_is_triton(target.device))
        self._padded_attention = not attention_is_kernel
        #: the target forward through CUDA graphs where a step fits one (``engine.cuda_graphs``)
        self.cuda_graphs = (CudaGraphs(target, cache, config.block_size, self.max_model_len, config.max_batch_size)
                            if config.cuda_graphs else None)
        self._tree_batch = self.batch_invariant and not attention_is_kernel
        self._warned: set[str] = set()
        #: drafter faults by kind (the requests' ``num_drafter_faults`` summed).
        self.drafter_faults: dict[str, int] = {}
        self.requests: dict[str, Request] = {}
        self.totals = RequestMetrics()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(seed)

    def _warm_up_compiled(self) -> None:
        """Compile the compiled target's graphs now, not on the first requests: one token of
        one sequence, two tokens of one, then one token each of two sequences, written into
        the first blocks (no request holds any yet)."""
        started = time.perf_counter()
        blocks, size, device = self.kv.pool.num_blocks, self.kv.block_size, self.target.device
        first = list(range(min(2, blocks)))
        for step in ([(first, 1)], [(first, 2)], [([0], 1), ([1], 1)]):
            if any(len(table) * size < count or max(table) >= blocks for table, count in step):
                continue
            layout = AttentionLayout([SequenceSlice(block_table=table, start=0,
                                                    positions=torch.arange(count, device=device))
                                      for table, count in step], size, device)
            tokens = layout.num_tokens
            self.target.forward(torch.zeros(tokens, dtype=torch.long, device=device), layout.query_positions,
                                ForwardMetadata(cache=self.kv.cache, layout=layout),
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
                      sampling_params=params, generator=generator)
        req.metrics.arrival_time = time.perf_counter()
        req.metrics.num_prompt_tokens = len(token_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """A RequestError if the request can never be served; callers queuing several
        requests check them all first, so a bad one leaves none behind."""
        if not token_ids:
            raise RequestError("the prompt is empty; give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.target.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                               f"(0..{self.target.vocab_size - 1})")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(token_ids)} tokens but the context holds {self.max_model_len} "
                               "(prompt + at least one generated token); shorten the prompt or raise "
                               "engine.max_model_len up to the model's limit")
        longest = min(len(token_ids) + params.max_tokens, self.max_model_len)
        self.kv.check_fits(longest)

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
        if self.hooks is not None:
            self.hooks.on_request_finished(request=req)

    # -- the step -------------------------------------------------------------------

    def _draft_shape(self, req: Request, batch_size: int, allowance: int) -> tuple[int, int]:
        """(depth, nodes) of the draft ``req`` may get this step: the schedule's, within the
        scheduler's allowance and the room left in the request and the context."""
        if self.spec is None or req.metrics.num_steps < req.speculation_paused_until:
            return 0, 0
        room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                   self.max_model_len - len(req.token_ids)) - 1
        depth, nodes = self._shape_for_batch(batch_size)
        depth = max(0, min(depth, room, allowance))
        return depth, (min(nodes, allowance) if depth else 0)

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        batch_size = len(self.scheduler.running) + min(len(self.scheduler.waiting), 1)
        nodes = self._shape_for_batch(max(batch_size, 1))[1] if self.spec else 0
        plan = self.scheduler.schedule(draft_budget=nodes)
        if plan.empty:
            return []
        items = [self._prefill_item(req, n) for req, n in plan.prefills]
        before_drafts = None if self.planner is None else StepShape(
            [(it.start, len(it.tokens)) for it in items] + [(r.num_computed, 1) for r in plan.decodes],
            padded=self._padded_attention, tree_batch=self._tree_batch)
        decodes, draft_seconds = self._decode_items(plan.decodes, plan.draft_allowance,
                                                    len(self.scheduler.running), before_drafts)
        items += decodes
        logits, hidden = self._forward(items)
        outputs = self._settle(items, logits, hidden)
        if self.planner is not None:
            sequences = [(it.start, len(it.tokens)) for it in items]
            widest = max((len(it.tokens) for it in items if not it.is_prefill), default=1)
            trees = self._tree_batch and any(it.proposal is not None and it.proposal.verified_as_tree for it in items)
            self.planner.observe_step(sum(n for _, n in sequences),
                                      attention_work(sequences, self._padded_attention, trees),
                                      time.perf_counter() - started - draft_seconds, widest)
        return outputs

    def _prefill_item(self, req: Request, n: int) -> _Item:
        start = req.num_computed
        done = start + n == req.prefill_target
        prompt_rows = range(0)
        if req.sampling_params.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
            prompt_rows = range(max(len(req.prompt_logprobs) - start, 0), max(min(n, req.prompt_len - 1 - start), 0))
        return _Item(request=req, tokens=req.token_ids[start:start + n], start=start,
                     positions=torch.arange(start, start + n), tree_mask=None,
                     num_logits=1 if done and req.num_output_tokens == 0 else 0, is_prefill=True,
                     prompt_rows=prompt_rows)

    def _decode_items(self, reqs: list[Request], allowances: list[int], batch_size: int,
                      before_drafts: StepShape | None) -> tuple[list[_Item], float]:
        """The decode items of the step, with their drafts, and the seconds spent drafting
        (``before_drafts``: the step's sequences, for the adaptive planner if there is one)."""
        shapes = [self._draft_shape(r, batch_size, a) for r, a in zip(reqs, allowances)]
        if self.planner is not None and self.hooks is not None:
            shapes = self.planner.plan(reqs, shapes, before_drafts)
        proposals: list[DraftProposal | None] = [None] * len(reqs)
        speculating = [i for i, (depth, _) in enumerate(shapes) if depth > 0]
        spent = 0.0
        if speculating and self.hooks is not None:
            started = time.perf_counter()
            try:
                with torch.inference_mode():  # drafters run no autograd
                    got = self.hooks.prepare_draft_tokens(requests=[reqs[i] for i in speculating],
                                                          draft_lens=[shapes[i][0] for i in speculating],
                                                          max_nodes=[shapes[i][1] for i in speculating])
                if got is not None and (not isinstance(got, (list, tuple)) or len(got) != len(speculating)):
                    raise TypeError(f"returned {got!r:.80} for {len(speculating)} requests; expected a list with "
                                    "one proposal or None per request")
            except Exception as exc:  # a failing drafter costs speed, never output
                self._drafter_fault([reqs[i] for i in speculating], "prepare_draft_tokens raised", exc)
                got = None
            spent = time.perf_counter() - started
            if self.planner is not None:
                self.planner.costs.observe_draft(max(shapes[i][0] for i in speculating), spent,
                                                 trees=any(shapes[i][1] > shapes[i][0] for i in speculating))
            answered = []  # requests whose drafter answered without a fault
            for i, prop in zip(speculating, got or []):
                reqs[i].metrics.draft_time += spent / len(speculating)
                problem = None if prop is None else proposal_problem(prop, self.target.vocab_size)
                if problem:
                    self._drafter_fault([reqs[i]], "invalid proposal", problem)
                    continue
                answered.append(i)
                if prop is not None:
                    proposals[i] = self._trim_proposal(prop, *shapes[i])
            if self.planner is not None:
                self.planner.observe_asks([reqs[i] for i in answered], [proposals[i] for i in answered])
        if self.planner is not None and any(p is not None for p in proposals):
            proposals = self.planner.trim(reqs, proposals, before_drafts)
        items = []
        for req, prop in zip(reqs, proposals):
            root = req.num_computed
            if prop is not None and not self.kv.can_reserve(req, 1 + len(prop.token_ids) + len(prop.aux_token_ids)):
                prop = None  # no KV room for drafts now: decode one token
            mask = None if prop is None else self._tree_mask(req, prop)
            if mask is None:
                items.append(_Item(request=req, tokens=[req.token_ids[-1]], start=root,
                                   positions=torch.tensor([root]), tree_mask=None, num_logits=1))
                continue
            tokens = [req.token_ids[-1], *prop.token_ids, *prop.aux_token_ids]
            self.kv.reserve(req, len(tokens))
            items.append(_Item(request=req, tokens=tokens, start=root, positions=root + mask.position_offsets,
                               tree_mask=mask.mask, num_logits=len(tokens), proposal=prop))
        return items, spent

    def _tree_mask(self, req: Request, prop: DraftProposal) -> TreeMask | None:
        """The proposal's verification mask, or None (a drafter fault: no drafts this step)."""
        try:
            mask = self.hooks.build_tree_mask(request=req, proposal=prop)
            problem = tree_mask_problem(mask, 1 + len(prop.token_ids) + len(prop.aux_token_ids))
        except Exception as exc:
            problem = exc
        if problem is None:
            return mask
        self._drafter_fault([req], "build_tree_mask failed", problem)
        return None

    def _drafter_fault(self, reqs: list[Request], kind: str, problem) -> None:
        """Count a drafter fault on each request (its metrics, the engine's totals by kind)
        and log the first of each kind with its traceback or reason."""
        for req in reqs:
            req.metrics.num_drafter_faults += 1
        self.drafter_faults[kind] = self.drafter_faults.get(kind, 0) + len(reqs)
        if kind not in self._warned:
            self._warned.add(kind)
            name = self.spec.decoding_type if self.spec else "drafter"
            log.error("%s drafter: %s (%s); those requests decode without drafts this step; counted in "
                      "num_drafter_faults, logged once per kind", name, kind,
                      f"{type(problem).__name__}: {problem}" if isinstance(problem, BaseException) else problem,
                      exc_info=problem if isinstance(problem, BaseException) else None)

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message + " (logged once)", *args)

    def _trim_proposal(self, prop: DraftProposal, max_depth: int, max_nodes: int) -> DraftProposal | None:
        """A proposal trimmed to the allowed depth and node count; None if nothing is left.
        Nodes come parents first, so the first ``max_nodes`` of them are a tree (drafters
        list their best nodes first)."""
        if not (prop.token_ids or prop.aux_token_ids):
            return None
        if prop.depth > max_depth:
            if not prop.is_chain:
                self._log_once("depth", "drafter proposed a tree of depth %d > draft length %d; trimmed",
                               prop.depth, max_depth)
            prop = prop.up_to_depth(max_depth)
        if prop is not None and len(prop.token_ids) > max_nodes:
            self._log_once("nodes", "drafter proposed %d nodes > max_total_draft_tokens %d; trimmed to its "
                           "first nodes", len(prop.token_ids), max_nodes)
            prop = prop.subset(list(range(max_nodes)))
        return prop if prop is not None and (prop.token_ids or prop.aux_token_ids) else None

    def _forward(self, items: list[_Item]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        device = self.target.device
        tokens, rows = [], []
        row = 0
        for it in items:
            n = len(it.tokens)
            it.row_offset = row
            it.logits_from = len(rows)
            tokens.extend(it.tokens)
            rows.extend(range(row + n - it.num_logits, row + n))
            row += n
        for it in items:
            if it.prompt_rows:
                it.prompt_logits_from = len(rows)
                rows.extend(it.row_offset + r for r in it.prompt_rows)
        layout = AttentionLayout([SequenceSlice(block_table=it.request.block_table, start=it.start,
                                                positions=it.positions, tree_mask=it.tree_mask) for it in items],
                                 self.kv.block_size, device)
        forward = self.target.forward if self.cuda_graphs is None else self.cuda_graphs.forward
        return forward(torch.tensor(tokens, device=device), layout.query_positions,
                       ForwardMetadata(cache=self.kv.cache, layout=layout, batch_invariant=self.batch_invariant),
                       torch.tensor(rows, device=device, dtype=torch.long))

    def _greedy_verdicts(self, items: list[_Item], logits: torch.Tensor) -> dict[int, Verdict]:
        """Verdicts of every plain-greedy item, prefill or decode, from one batched verification."""
        chosen = [it for it in items if it.num_logits and self._plain_greedy(it.request.sampling_params)
                  and (it.proposal is None or self.acceptance_rule is None)]
        if not chosen:
            return {}
        rows = torch.cat([torch.arange(it.logits_from, it.logits_from + 1 + self._num_nodes(it)) for it in chosen])
        argmax = logits.argmax(-1).index_select(0, rows.to(logits.device))
        verdicts = verify_greedy_batch(argmax, [it.proposal for it in chosen])
        return {id(it): v for it, v in zip(chosen, verdicts)}

    @staticmethod
    def _num_nodes(it: _Item) -> int:
        return len(it.proposal.token_ids) if it.proposal is not None else 0

    def _settle(self, items: list[_Item], logits: torch.Tensor, hidden: dict[int, torch.Tensor]) -> list[StepOutput]:
        greedy = self._greedy_verdicts(items, logits)
        results: list[StepResult] = []
        moves_src, moves_dst = [], []
        kept_rows = []  # per result, the forward's rows whose KV it commits
        kept_slots = []  # their KV slots, where the hidden cache keeps their states
        prefixes = {}  # result index -> the prefix cache's stored states, put before its chunk's
        logprob_rows = {}  # result index -> the logits rows of its new tokens, where it asks their logprobs
        prompt_asks = []  # (request, logits rows, the prompt tokens they predict) where prompt logprobs are asked
        keep_states = self.hidden_cache is not None
        for it in items:
            req = it.request
            if it.is_prefill:
                self.kv.commit(req, it.start + len(it.tokens))
                new = [] if not it.num_logits else (
                    greedy[id(it)].tokens if id(it) in greedy else self._sample_first(req, it, logits))
                if new and req.sampling_params.logprobs is not None:
                    logprob_rows[len(results)] = [it.logits_from]
                if it.prompt_rows:
                    first = it.start + it.prompt_rows.start + 1
                    prompt_asks.append((req, range(it.prompt_logits_from, it.prompt_logits_from + len(it.prompt_rows)),
                                        req.token_ids[first:first + len(it.prompt_rows)]))
                start = it.start
                kept_rows.append(range(it.row_offset, it.row_offset + len(it.tokens)))
                if keep_states:
                    kept_slots += self.kv.slots(req, it.start, len(it.tokens))
                    if start and start == req.num_from_prefix_cache:
                        slots = torch.tensor(self.kv.slots(req, 0, start), device=self.target.device)
                        prefixes[len(results)] = self.hidden_cache.read(slots)
                        start = 0
                results.append(StepResult(request=req, new_token_ids=new, is_prefill=True, start=start))
                continue
            verdict = greedy.get(id(it)) or self._verify(req, it, logits)
            root = it.start
            for k, node in enumerate(verdict.accepted_nodes, start=1):
                moves_src.extend(self.kv.slots(req, root + 1 + node, 1))
                moves_dst.extend(self.kv.slots(req, root + k, 1))
            kept_rows.append([it.row_offset, *(it.row_offset + 1 + n for n in verdict.accepted_nodes)])
            if keep_states:
                kept_slots += self.kv.slots(req, root, len(kept_rows[-1]))
            aux = None
            if it.proposal is not None and it.proposal.aux_token_ids:
                first_aux = it.logits_from + 1 + len(it.proposal.token_ids)
                aux = logits[first_aux:first_aux + len(it.proposal.aux_token_ids)]
            if req.sampling_params.logprobs is not None:
                logprob_rows[len(results)] = [it.logits_from, *(it.logits_from + 1 + n for n in verdict.accepted_nodes)]
            results.append(StepResult(request=req, new_token_ids=verdict.tokens, proposal=it.proposal, start=root,
                                      accepted_nodes=verdict.accepted_nodes, aux_logits=aux))
        if moves_src:
            self.kv.move(moves_src, moves_dst, self.target.device)
        if hidden:
            self._hand_over_hidden(results, hidden, kept_rows, kept_slots, prefixes)
        asks = [(rows, results[i].new_token_ids, results[i].request.sampling_params.logprobs)
                for i, rows in logprob_rows.items()]
        asks += [(rows, tokens, req.sampling_params.prompt_logprobs) for req, rows, tokens in prompt_asks]
        answers = self._token_logprobs(asks, logits)
        logprobs = dict(zip(logprob_rows, answers))
        for (req, _, _), entries in zip(prompt_asks, answers[len(logprob_rows):]):
            req.prompt_logprobs += entries
        outputs = []
        for i, res in enumerate(results):
            req = res.request
            out = self._append(req, res.new_token_ids)
            if i in logprobs:  # the tokens kept: a stop may have cut the step's tokens short
                req.output_logprobs += logprobs[i][:len(out.new_token_ids)]
            if not res.is_prefill:
                accepted = len(res.accepted_nodes)
                # a stop (EOS, stop string, length) inside the accepted drafts shortens the output
                self.kv.commit(req, min(req.num_computed + 1 + accepted, len(req.token_ids) - 1))
                self._record(req, res.proposal, res.accepted_nodes, len(out.new_token_ids))
            outputs.append(out)
        if self.hooks is not None:
            try:
                with torch.inference_mode():
                    self.hooks.on_draft_verified(results=results)
            except Exception as exc:  # the drafter's state may be off: costs speed, never output
                self._drafter_fault([r.request for r in results], "on_draft_verified raised", exc)
        for out in outputs:
            if out.finished:
                self._finish(out.request, out.request.finish_reason)
        return outputs

    def _hand_over_hidden(self, results: list[StepResult], hidden: dict[int, torch.Tensor], rows: list,
                          slots: list[int], prefixes: dict[int, dict[int, torch.Tensor]]) -> None:
        """Give each result the hidden states of its committed ``rows`` of the forward (one
        row list per result), after the stored states of its cached prefix where
        ``prefixes`` has them, and keep them in the hidden cache at their KV ``slots``: one
        gather per layer for the whole step (gathered request by request, EAGLE-3's three
        layers were 24 small copies a step at batch 8, twice over with the hidden cache's own)."""
        device = next(iter(hidden.values())).device
        flat = torch.tensor([r for result_rows in rows for r in result_rows], device=device)
        kept = {layer: h.index_select(0, flat) for layer, h in hidden.items()}
        if self.hidden_cache is not None and slots:
            self.hidden_cache.write(torch.tensor(slots, device=device), kept)
        first = 0
        for i, (res, result_rows) in enumerate(zip(results, rows)):
            n = len(result_rows)
            states = {layer: h[first:first + n] for layer, h in kept.items()}
            if i in prefixes:
                states = {layer: torch.cat([prefixes[i][layer], h]) for layer, h in states.items()}
            res.hidden_states = states
            first += n

    @staticmethod
    def _token_logprobs(asks: list[tuple[Sequence[int], list[int], int]], logits: torch.Tensor
                        ) -> list[list[dict[int, float]]]:
        """For each ask (logits rows, the token each row chose or predicts, how many top
        tokens), one dict per token: its log-probability under the target's own distribution
        at its row (its first key), then those of the most likely tokens there. One
        log-softmax over every ask's rows in the step; a verified draft token's row is the
        row plain decoding would have read, so its figures are plain decoding's."""
        if not asks:
            return []
        flat = torch.tensor([r for rows, _, _ in asks for r in rows], device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, flat).float(), dim=-1)
        tokens = torch.tensor([t for _, ask_tokens, _ in asks for t in ask_tokens], device=logits.device)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
        k = max(num_top for _, _, num_top in asks)
        top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        out, row = [], 0
        for _, ask_tokens, num_top in asks:
            entries = []
            for token in ask_tokens:
                entry = {token: chosen[row]}
                for top_id, value in zip(top_ids[row][:num_top], top_values[row][:num_top]):
                    entry.setdefault(top_id, value)
                entries.append(entry)
                row += 1
            out.append(entries)
        return out

    def _probs(self, req: Request, logits: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
        params = req.sampling_params
        return probs_from_logits(apply_repetition_penalty(logits, histories, params.repetition_penalty), params)

    def _plain_greedy(self, params: SamplingParams) -> bool:
        return params.greedy and params.repetition_penalty == 1.0

    def _sample_first(self, req: Request, it: _Item, logits: torch.Tensor) -> list[int]:
        probs = self._probs(req, logits[it.logits_from:it.logits_from + 1], [req.token_ids])
        return verify_sampled(probs, None, req.generator).tokens

    def _verify(self, req: Request, it: _Item, logits: torch.Tensor) -> Verdict:
        params, prop = req.sampling_params, it.proposal
        histories = [req.token_ids]
        if prop is not None:
            paths: list[list[int]] = []
            for tok, parent in zip(prop.token_ids, prop.parents):
                paths.append((paths[parent] if parent >= 0 else []) + [tok])
            histories += [req.token_ids + p for p in paths]
        rows = logits[it.logits_from:it.logits_from + 1 + self._num_nodes(it)]
        probs = self._probs(req, rows, histories)
        if prop is not None and self.acceptance_rule is not None:
            verdict = self.acceptance_rule.verify(probs, rows, prop, req)
            if verdict is not None:  # None: outside the rule's scope, verified exactly below
                req.metrics.lossless = False
                return verdict
        if params.greedy:  # greedy with a repetition penalty, or outside a lossy rule's scope
            return verify_greedy(probs.argmax(-1).tolist(), prop)
        return verify_sampled(probs, prop, req.generator)

    def _record(self, req: Request, prop: DraftProposal | None, accepted_nodes: list[int], emitted: int) -> None:
        depth = prop.depth if prop is not None else 0
        accepted = len(accepted_nodes)
        req.metrics.record_step(depth, len(prop.token_ids) if prop is not None else 0, accepted, emitted)
        req.steps_without_drafts = 0 if depth else req.steps_without_drafts + 1
        if depth and self.planner is not None:
            self.planner.observe_verified(req, prop, accepted_nodes)
        if depth == 0 or self.spec is None or self.spec.min_acceptance_rate <= 0:
            return
        req.recent_acceptance.append(accepted / depth)
        window = self.spec.acceptance_window
        if len(req.recent_acceptance) >= window:
            recent = list(req.recent_acceptance)[-window:]
            if sum(recent) / window < self.spec.min_acceptance_rate:
                req.speculation_paused_until = req.metrics.num_steps + self.spec.retry_after
                req.recent_acceptance.clear()

    def _append(self, req: Request, new: list[int]) -> StepOutput:
        """Append accepted tokens one by one, stopping at EOS, stop ids, max_tokens or the context end."""
        params = req.sampling_params
        appended: list[int] = []
        for tok in new:
            req.token_ids.append(tok)
            appended.append(tok)
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = time.perf_counter()
            if (tok in self.target.eos_token_ids and not params.ignore_eos) or tok in params.stop_token_ids:
                req.finish_reason = "stop"
            elif req.num_output_tokens >= params.max_tokens or len(req.token_ids) >= self.max_model_len:
                req.finish_reason = "length"
            if req.finish_reason is not None:
                break
        if params.stop and self.target.tokenizer is not None:
            kept = self._cut_at_stop_string(req, len(appended))
            del appended[kept:]
        return StepOutput(request=req, new_token_ids=appended, finished=req.finish_reason is not None)

    def _stop_hit(self, req: Request, num_output: int) -> str | None:
        """The output text of the first ``num_output`` tokens cut before its first stop
        string, or None if it holds none."""
        text = self.target.tokenizer.decode(req.output_token_ids[:num_output], skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in req.sampling_params.stop) if i >= 0]
        return text[:min(hits)] if hits else None

    def _cut_at_stop_string(self, req: Request, num_new: int) -> int:
        """End the request at the token that completes a stop string, dropping the tokens
        after it (accepted drafts go past it), so speculative output equals plain output;
        returns how many of the ``num_new`` new tokens remain."""
        total = req.num_output_tokens
        if self._stop_hit(req, total) is None:
            return num_new
        kept = next(k for k in range(1, num_new + 1) if self._stop_hit(req, total - num_new + k) is not None)
        del req.token_ids[len(req.token_ids) - (num_new - kept):]
        req.stop_text = self._stop_hit(req, req.num_output_tokens)
        req.finish_reason = "stop"
        return kept
