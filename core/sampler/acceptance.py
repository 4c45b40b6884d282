"""Acceptance rules: which draft tokens the target keeps, and the bonus/correction token.

Rows of the target distribution: row 0 is the root (the request's last committed token),
row ``k + 1`` is draft node ``k``. Row ``r`` is the target's distribution of the token that
follows row ``r``'s token.

* greedy: follow the children whose token is the target's argmax; the bonus is the argmax.
* sampled (lossless): recursive rejection sampling. At each node the children are tried in
  order; child ``x`` drawn from ``q`` is accepted with ``min(1, p(x)/q(x))``; on rejection
  ``p <- norm(max(0, p - q))`` and, for children drawn without replacement, ``q`` loses
  ``x``. Deterministic children (no randomness in the drafter) have a one-hot ``q``. With
  no child accepted, the correction token is drawn from the final ``p``; after a fully
  accepted path the bonus token is drawn from the last node's row.
"""

from __future__ import annotations

import attrs
import torch

from ..drafting import DraftProposal


@attrs.define
class Verdict:
    accepted_nodes: list[int]
    tokens: list[int]  # accepted draft tokens, then the bonus/correction token


def children_of(parents: list[int]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {-1: []}
    for node, parent in enumerate(parents):
        kids.setdefault(parent, []).append(node)
        kids.setdefault(node, [])
    return kids


def verify_greedy(target_tokens: list[int], proposal: DraftProposal | None) -> Verdict:
    """``target_tokens[r]``: the argmax of row ``r``."""
    if proposal is None or not proposal.token_ids:
        return Verdict([], [target_tokens[0]])
    kids = children_of(proposal.parents)
    draft = proposal.token_ids
    node, accepted = -1, []
    while True:
        want = target_tokens[node + 1]
        node = next((k for k in kids[node] if draft[k] == want), None)
        if node is None:
            return Verdict(accepted, [draft[n] for n in accepted] + [want])
        accepted.append(node)


def _sample(p: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(p, 1, generator=generator))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def verify_sampled(target_probs: torch.Tensor, proposal: DraftProposal | None,
                   generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling over a chain or tree; output follows ``target_probs``."""
    if proposal is None or not proposal.token_ids:
        return Verdict([], [_sample(target_probs[0], generator)])
    kids = children_of(proposal.parents)
    draft = proposal.token_ids
    one_hot = proposal.sibling_sampling == "deterministic" or proposal.draft_probs is None
    vocab = target_probs.shape[-1]
    node, accepted = -1, []
    while kids[node]:
        p = target_probs[node + 1]
        q_removed: list[int] = []
        chosen = None
        for kid in kids[node]:
            x = draft[kid]
            if one_hot:
                q = torch.zeros(vocab, device=p.device)
                q[x] = 1.0
            else:
                q = proposal.draft_probs[kid].float()
                if q_removed:  # drawn without replacement: earlier siblings are out of q
                    q = q.clone()
                    q[q_removed] = 0.0
                    q = q / q.sum()
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * float(q[x]) < float(p[x]):
                chosen = kid
                break
            p = _residual(p, q)
            if proposal.sibling_sampling == "without_replacement":
                q_removed.append(x)
        if chosen is None:
            return Verdict(accepted, [draft[n] for n in accepted] + [_sample(p, generator)])
        accepted.append(chosen)
        node = chosen
    return Verdict(accepted, [draft[n] for n in accepted] + [_sample(target_probs[node + 1], generator)])
