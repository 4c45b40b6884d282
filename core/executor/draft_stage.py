"""The draft stage of a step: the decode items, each with the draft its drafter proposed.

It asks the planner how much each request may draft, calls the drafter's hooks once for
the batch, checks and trims what comes back (dropping what a request's grammar forbids),
reserves KV for it and builds its verification mask; after verification it hands the
results to the drafter. A method with a lookup drafter (``speculative_config.lookup``)
has the lookup asked first, for every decoding request, and the method only for the
requests whose lookup draft the planner does not prefer
(:meth:`~specdec.executor.planner.DraftPlanner.prefer_lookup`): a lookup costs no model
forward, the method's levels do. A drafter fault (an exception, a malformed proposal or
mask) costs the requests concerned their drafts this step, never output: it is counted per
kind and logged once.
"""

from __future__ import annotations

import logging
import time

import attrs
import pluggy
import torch

from ..drafting.interface import LOOKUP_KIND, DraftProposal, StepResult, TreeMask, proposal_problem, tree_mask_problem
from ..kvcache import KVCacheManager
from .planner import DraftPlanner, StepShape
from .request import Request
from .step_items import StepItem

log = logging.getLogger(__name__)


def _grammatical(req: Request, prop: DraftProposal) -> tuple[DraftProposal | None, torch.Tensor | None]:
    """``prop`` without the nodes its request's grammar forbids, which the forward then
    skips, with the grammar's bitmask rows of what is left (root first; the verifier
    masks with them). Only where dropping them leaves the output's distribution as it was:
    greedy requests, and drafts without a distribution (a forbidden token's one-hot ``q``
    leaves the rejection sampler's residual the target's own); a draft drawn from a
    distribution keeps them (no rows: the verifier computes them), and verification
    rejects them (the masked target gives them 0)."""
    if not (req.sampling_params.greedy or prop.draft_probs is None or prop.sibling_sampling == "deterministic"):
        return prop, None
    started = time.perf_counter()
    bitmask, reachable = req.grammar.masks(prop)
    req.metrics.grammar_time += time.perf_counter() - started
    if all(reachable):
        return prop, bitmask
    keep = [node for node, ok in enumerate(reachable) if ok]
    rows = bitmask[[0] + [node + 1 for node in keep]]  # a node's row depends on its own path only
    return (prop.subset(keep) if keep or prop.aux_token_ids else None), rows


class DraftStage:
    """Drafts for the step's decoding requests (``planner`` None: no speculation);
    ``propose`` and ``propose_lookup`` are ``prepare_draft_tokens`` of the method and of its
    lookup drafter (None: none), each alone (:func:`specdec.plugins.proposal_callers`)."""

    def __init__(self, hooks: pluggy.HookRelay | None, planner: DraftPlanner | None, kv: KVCacheManager,
                 vocab_size: int, max_model_len: int, method: str, propose: pluggy.HookCaller | None = None,
                 propose_lookup: pluggy.HookCaller | None = None):
        self.hooks = hooks
        self.propose = propose
        self.propose_lookup = propose_lookup
        self.planner = planner
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.method = method
        #: drafter faults by kind (the requests' ``num_drafter_faults`` summed)
        self.faults: dict[str, int] = {}
        #: seconds the drafters took in the last step
        self.seconds = 0.0
        self._warned: set[str] = set()

    def draft_budget(self, batch_size: int) -> int:
        """Draft nodes the scheduler keeps room for per decoding request."""
        return self.planner.draft_budget(batch_size) if self.planner is not None else 0

    def decode_items(self, reqs: list[Request], allowances: list[int], batch_size: int,
                     before_drafts: StepShape) -> list[StepItem]:
        """One item per request in ``reqs``, with the draft worth verifying where there is one."""
        self.seconds = 0.0
        if self.planner is None or self.hooks is None or not reqs:
            return [StepItem.decode(req) for req in reqs]
        shapes = self.planner.shapes(reqs, allowances, batch_size, self.max_model_len, before_drafts)
        lookups = None
        if self.propose_lookup is not None:
            started = time.perf_counter()
            lookups, asked = self._lookups(reqs, allowances, batch_size, before_drafts)
            preferred = self.planner.prefer_lookup(reqs, lookups, shapes, before_drafts)
            shapes = [(0, 0) if lookup else shape for shape, lookup in zip(shapes, preferred)]
            if asked:  # what asking the lookup and pricing its drafts took
                self.planner.observe_lookup(asked, time.perf_counter() - started)
        proposals = self._propose(reqs, shapes)
        if lookups is not None:
            proposals = [lookup if use else prop for prop, lookup, use in zip(proposals, lookups, preferred)]
        if any(p is not None for p in proposals):
            proposals = self.planner.trim(reqs, proposals, before_drafts)
        items = []
        for req, prop in zip(reqs, proposals):
            grammar_rows = None
            if prop is not None and req.grammar is not None:
                prop, grammar_rows = _grammatical(req, prop)
            if prop is not None and not self.kv.can_reserve(req, 1 + len(prop.token_ids) + len(prop.aux_token_ids)):
                prop = None  # no KV room for drafts now: decode one token
            mask = None if prop is None else self._tree_mask(req, prop)
            item = StepItem.decode(req) if mask is None else StepItem.decode(req, prop, mask)
            if mask is not None:
                self.kv.reserve(req, len(item.tokens))
            if grammar_rows is not None:  # the root's row alone where the draft went
                item.grammar_rows = grammar_rows[:1 + item.num_nodes]
            items.append(item)
        return items

    def observe(self, results: list[StepResult]) -> None:
        """Hand the step's results to the drafter's hooks (``on_draft_verified``)."""
        if self.hooks is None:
            return
        try:
            with torch.inference_mode():
                self.hooks.on_draft_verified(results=results)
        except Exception as exc:  # the drafter's state may be off: costs speed, never output
            self._fault([r.request for r in results], "on_draft_verified raised", exc)

    def _lookups(self, reqs: list[Request], allowances: list[int], batch_size: int, before_drafts: StepShape
                 ) -> tuple[list[DraftProposal | None], int]:
        """The lookup drafter's proposals, of kind ``(LOOKUP_KIND, its own)``, and how many
        requests it was asked for."""
        shapes = self.planner.lookup_shapes(reqs, allowances, batch_size, self.max_model_len, before_drafts)
        asking = [i for i, (depth, _) in enumerate(shapes) if depth > 0]
        found, _, _ = self._ask(self.propose_lookup, "lookup", reqs, shapes, asking)
        tagged = [None if prop is None else attrs.evolve(prop, kind=(LOOKUP_KIND, prop.kind)) for prop in found]
        return tagged, len(asking)

    def _propose(self, reqs: list[Request], shapes: list[tuple[int, int]]) -> list[DraftProposal | None]:
        """The method's proposals for the requests given a depth, each checked and trimmed
        to its shape (None: no draft); the planner learns what asking cost and brought."""
        speculating = [i for i, (depth, _) in enumerate(shapes) if depth > 0]
        proposals, answered, seconds = self._ask(self.propose, "", reqs, shapes, speculating)
        if speculating:
            self.planner.observe_drafting([reqs[i] for i in speculating], max(shapes[i][0] for i in speculating),
                                          seconds, trees=any(shapes[i][1] > shapes[i][0] for i in speculating))
            self.planner.observe_asks([reqs[i] for i in answered], [proposals[i] for i in answered])
        return proposals

    def _ask(self, propose: pluggy.HookCaller, who: str, reqs: list[Request], shapes: list[tuple[int, int]],
             speculating: list[int]) -> tuple[list[DraftProposal | None], list[int], float]:
        """``propose``'s proposals for the requests ``speculating`` (indices into ``reqs``)
        given a depth, each checked and trimmed to its shape (None: no draft), the indices of
        the requests it answered without a fault, and the seconds it took, which are added
        to :attr:`seconds` (``who``: ``lookup`` or the method)."""
        proposals: list[DraftProposal | None] = [None] * len(reqs)
        if not speculating:
            return proposals, [], 0.0
        asked = [reqs[i] for i in speculating]
        started = time.perf_counter()
        try:
            with torch.inference_mode():  # drafters run no autograd
                got = propose(requests=asked, draft_lens=[shapes[i][0] for i in speculating],
                              max_nodes=[shapes[i][1] for i in speculating])
            if got is not None and (not isinstance(got, (list, tuple)) or len(got) != len(speculating)):
                raise TypeError(f"returned {got!r:.80} for {len(speculating)} requests; expected a list with "
                                "one proposal or None per request")
        except Exception as exc:  # a failing drafter costs speed, never output
            self._fault(asked, f"{who} prepare_draft_tokens raised".lstrip(), exc)
            got = None
        seconds = time.perf_counter() - started
        self.seconds += seconds
        answered = []
        for i, prop in zip(speculating, got or []):
            reqs[i].metrics.draft_time += seconds / len(speculating)
            problem = None if prop is None else proposal_problem(prop, self.vocab_size)
            if problem:
                self._fault([reqs[i]], f"{who} invalid proposal".lstrip(), problem)
                continue
            answered.append(i)
            if prop is not None:
                proposals[i] = self._trimmed(prop, *shapes[i])
        return proposals, answered, seconds

    def _trimmed(self, prop: DraftProposal, max_depth: int, max_nodes: int) -> DraftProposal | None:
        """``prop`` cut to the allowed depth and node count; None if nothing is left.
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

    def _tree_mask(self, req: Request, prop: DraftProposal) -> TreeMask | None:
        """The proposal's verification mask, or None (a drafter fault: no drafts this step)."""
        try:
            mask = self.hooks.build_tree_mask(request=req, proposal=prop)
            problem = tree_mask_problem(mask, 1 + len(prop.token_ids) + len(prop.aux_token_ids))
        except Exception as exc:
            problem = exc
        if problem is None:
            return mask
        self._fault([req], "build_tree_mask failed", problem)
        return None

    def _fault(self, reqs: list[Request], kind: str, problem) -> None:
        """Count a drafter fault on each request and log the first of each kind."""
        for req in reqs:
            req.metrics.num_drafter_faults += 1
        self.faults[kind] = self.faults.get(kind, 0) + len(reqs)
        if kind not in self._warned:
            self._warned.add(kind)
            log.error("%s drafter: %s (%s); those requests decode without drafts this step; counted in "
                      "num_drafter_faults, logged once per kind", self.method, kind,
                      f"{type(problem).__name__}: {problem}" if isinstance(problem, BaseException) else problem,
                      exc_info=problem if isinstance(problem, BaseException) else None)

    def _log_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning(message + " (logged once)", *args)
