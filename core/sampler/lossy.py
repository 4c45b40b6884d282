"""Opt-in acceptance rules that trade exactness for longer accepted runs. NOT lossless.

A method's config returns one of these from ``acceptance_rule()`` only when the user
switches it on (Medusa's ``use_typical_acceptance``, MTP's
``use_relaxed_acceptance_for_thinking``); otherwise verification is exact.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ..drafting.interface import DraftProposal
from .acceptance import Verdict, children_of, draw


def _walk(judge: torch.Tensor, probs: torch.Tensor, proposal: DraftProposal,
          accept: Callable[[torch.Tensor, int], bool], request) -> Verdict:
    """From the root, follow the most likely child (by ``judge``) that ``accept`` admits; the
    last token is the argmax (greedy) or a sample of ``probs`` at the last accepted node."""
    kids = children_of(proposal.parents)
    node, accepted = -1, []
    while True:
        row = judge[node + 1]
        ok = [k for k in kids[node] if accept(row, proposal.token_ids[k])]
        if not ok:
            last = probs[node + 1]
            final = int(last.argmax()) if request.sampling_params.greedy else draw(last, request.generator)
            return Verdict(accepted, [proposal.token_ids[n] for n in accepted] + [final])
        node = max(ok, key=lambda k: float(row[proposal.token_ids[k]]))
        accepted.append(node)


@attrs.frozen
class TypicalAcceptance:
    """Medusa's typical acceptance: accept draft ``x`` when
    ``p(x) > min(posterior_threshold, posterior_alpha * exp(-entropy(p)))``, ``p`` being the
    target's distribution after the request's logits processing (greedy requests: one-hot,
    so they stay exact)."""

    posterior_threshold: float
    posterior_alpha: float

    def verify(self, probs: torch.Tensor, logits: torch.Tensor, proposal: DraftProposal, request) -> Verdict:
        def accept(row: torch.Tensor, token: int) -> bool:
            entropy = -(row * torch.log(row.clamp_min(1e-12))).sum()
            return float(row[token]) > min(self.posterior_threshold, self.posterior_alpha * float(torch.exp(-entropy)))

        return _walk(probs, probs, proposal, accept, request)


@attrs.frozen
class RelaxedAcceptance:
    """MTP relaxed acceptance (TensorRT-LLM's): inside a thinking phase (after
    ``begin_token``, before ``end_token``; always, when no begin token is set) a draft token
    is accepted when it is among the target's ``topk`` most likely tokens (softmax of the raw
    logits) and ``p(x) >= p(top1) - delta``. Outside it, verify returns None and the exact
    rule decides."""

    topk: int
    delta: float
    begin_token: int | None = None
    end_token: int | None = None

    def in_thinking(self, token_ids: list[int]) -> bool:
        if self.begin_token is None:
            return True
        last = {t: i for i, t in enumerate(token_ids) if t in (self.begin_token, self.end_token)}
        return last.get(self.begin_token, -1) > last.get(self.end_token, -1)

    def verify(self, probs: torch.Tensor, logits: torch.Tensor, proposal: DraftProposal, request) -> Verdict | None:
        if not self.in_thinking(request.token_ids):
            return None

        def accept(row: torch.Tensor, token: int) -> bool:
            top = torch.topk(row, min(self.topk, row.numel()))
            return token in top.indices.tolist() and float(row[token]) >= float(top.values[0]) - self.delta

        return _walk(torch.softmax(logits.float(), -1), probs, proposal, accept, request)
