"""The verify stage: from the step's logits, the tokens each request keeps.

A drafted request keeps the longest path of its draft that the target accepts, then one
token of the target's own (the bonus or correction token): greedy requests by argmax
(every plain-greedy row of the step in one batched comparison), sampled requests by
recursive rejection sampling, so output follows the target's distribution; a request with
a seed by the target's own draw at each position from numbers that depend on the seed and
the position alone, so the same seed gives the same output however it was drafted or
batched. An opt-in lossy acceptance rule (Medusa's typical, MTP's relaxed acceptance)
verifies what is in its scope and marks the request not lossless. A prompt chunk that ends the prompt draws the
first output token. A request with structured output has its rows masked first, each to
the tokens its grammar allows after that row's path, so every rule verifies against the
constrained target.
"""

from __future__ import annotations

import time

import torch

from ..drafting.interface import StepResult
from ..kernels import argmax_rows
from ..sampler import TargetRows, Verdict, verify_greedy, verify_greedy_batch, verify_sampled, verify_seeded
from ..sampler.grammar import apply_masks
from ..sampling_params import SamplingParams
from .request import Request
from .step_items import StepItem


def _plain_greedy(params: SamplingParams) -> bool:
    return params.greedy and not params.shapes_logits


def _mask_grammars(items: list[StepItem], logits: torch.Tensor) -> None:
    """Mask, in place, the rows of each request with a grammar to the tokens it allows
    there; the time is counted in each request's ``grammar_time`` (masking by its share of rows)."""
    constrained = [it for it in items if it.request.grammar is not None and it.num_logits]
    if not constrained:
        return
    rows, masks = [], []
    for it in constrained:
        bitmask = it.grammar_rows
        if bitmask is None:  # not computed by the draft stage
            started = time.perf_counter()
            bitmask, _ = it.request.grammar.masks(it.proposal)
            it.request.metrics.grammar_time += time.perf_counter() - started
        rows.append(torch.arange(it.logits_from, it.logits_from + len(bitmask)))
        masks.append(bitmask)
    started = time.perf_counter()
    apply_masks(logits, torch.cat(rows), torch.cat(masks))
    per_row = (time.perf_counter() - started) / sum(len(r) for r in rows)
    for it, its_rows in zip(constrained, rows):
        it.request.metrics.grammar_time += per_row * len(its_rows)


class Verifier:
    def __init__(self, eos_token_ids: frozenset[int] | set[int], acceptance_rule=None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.acceptance_rule = acceptance_rule

    def verify(self, items: list[StepItem], logits: torch.Tensor) -> list[StepResult]:
        """One result per item: the tokens it keeps, with its accepted draft nodes and the
        target logits of its aux tokens."""
        _mask_grammars(items, logits)
        greedy = self._greedy_verdicts(items, logits)
        results = []
        for it in items:
            req = it.request
            if it.is_prefill:
                new = [] if not it.num_logits else (
                    greedy[id(it)].tokens if id(it) in greedy else self._sample_first(req, it, logits))
                results.append(StepResult(request=req, new_token_ids=new, is_prefill=True, start=it.start))
                continue
            verdict = greedy.get(id(it)) or self._verify(req, it, logits)
            aux = None
            if it.proposal is not None and it.proposal.aux_token_ids:
                first_aux = it.logits_from + 1 + it.num_nodes
                aux = logits[first_aux:first_aux + len(it.proposal.aux_token_ids)]
            results.append(StepResult(request=req, new_token_ids=verdict.tokens, proposal=it.proposal,
                                      start=it.start, accepted_nodes=verdict.accepted_nodes, aux_logits=aux))
        return results

    def _greedy_verdicts(self, items: list[StepItem], logits: torch.Tensor) -> dict[int, Verdict]:
        """Verdicts of every plain-greedy item, prefill or decode, from one batched verification."""
        chosen = [it for it in items if it.num_logits and _plain_greedy(it.request.sampling_params)
                  and (it.proposal is None or self.acceptance_rule is None)]
        if not chosen:
            return {}
        rows = [row for it in chosen for row in range(it.logits_from, it.logits_from + 1 + it.num_nodes)]
        argmax = argmax_rows(logits)
        if rows != list(range(len(argmax))):  # other rows in the step: pick the chosen ones
            argmax = argmax.index_select(0, torch.tensor(rows, device=argmax.device))
        verdicts = verify_greedy_batch(argmax, [it.proposal for it in chosen])
        return {id(it): v for it, v in zip(chosen, verdicts)}

    def _rows(self, req: Request, it: StepItem, logits: torch.Tensor) -> TargetRows:
        rows = logits[it.logits_from:it.logits_from + 1 + it.num_nodes]
        return TargetRows(rows, req.token_ids, it.proposal, req.sampling_params, req.prompt_len, self.eos_token_ids)

    def _sample_first(self, req: Request, it: StepItem, logits: torch.Tensor) -> list[int]:
        return self._sampled(req, self._rows(req, it, logits), None).tokens

    def _verify(self, req: Request, it: StepItem, logits: torch.Tensor) -> Verdict:
        params, prop = req.sampling_params, it.proposal
        rows = self._rows(req, it, logits)
        if prop is not None and self.acceptance_rule is not None:
            verdict = self.acceptance_rule.verify(rows.all(), rows.logits, prop, req)
            if verdict is not None:  # None: outside the rule's scope, verified exactly below
                req.metrics.lossless = False
                return verdict
        if params.greedy:  # greedy with penalties or biases, or outside a lossy rule's scope
            return verify_greedy(argmax_rows(rows.all()).tolist(), prop)
        return self._sampled(req, rows, prop)

    @staticmethod
    def _sampled(req: Request, rows: TargetRows, prop) -> Verdict:
        seed = req.sampling_params.seed
        if seed is not None:
            return verify_seeded(rows, prop, seed, len(req.token_ids))
        return verify_sampled(rows, prop, req.generator)
