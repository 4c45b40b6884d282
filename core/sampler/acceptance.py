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
* seeded (lossless and reproducible): the token at sequence position ``t`` is the target's
  own draw with a uniform number that depends only on the seed and ``t`` (inverse CDF);
  the children whose token equals that draw are followed, as in greedy verification. The
  output is then the one plain sampling gives with that seed whatever was drafted, and
  however the request was batched: rejection sampling's draws depend on how many drafts
  each step verified. A draft drawn from ``q`` is kept with ``p(x)`` rather than
  ``min(1, p(x) / q(x))``; for deterministic drafts the two are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ..drafting.interface import DraftProposal
from ..kernels import chain_rejection, cpu_kernel_available, greedy_tree_verify, inverse_cdf_cpu, use_triton


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


def _pack(proposals: list[DraftProposal | None], device) -> tuple:
    tokens, parents, row_start, node_start, num = [], [], [], [], []
    rows = 0
    for prop in proposals:
        n = len(prop.token_ids) if prop is not None else 0
        row_start.append(rows)
        node_start.append(len(tokens))
        num.append(n)
        if n:
            tokens += prop.token_ids
            parents += prop.parents
        rows += n + 1
    as_tensor = lambda x: torch.tensor(x or [0], dtype=torch.int32, device=device)  # noqa: E731
    return as_tensor(tokens), as_tensor(parents), as_tensor(row_start), as_tensor(node_start), as_tensor(num)


def verify_greedy_batch(target_tokens: torch.Tensor, proposals: list[DraftProposal | None]) -> list[Verdict]:
    """Greedy verification of many requests at once (one kernel on CUDA; elsewhere the
    walk of :func:`follow_tokens` over the rows' tokens as a list, which the kernel's torch
    reference would pack the proposals into tensors for).

    ``target_tokens``: the argmax of every row, packed request after request (root row,
    then one row per draft node).
    """
    if not use_triton(target_tokens, "greedy_tree_verify_triton"):
        tokens, verdicts, first = target_tokens.tolist(), [], 0
        for prop in proposals:
            verdicts.append(follow_tokens(prop, lambda row, depth, first=first: tokens[first + row]))
            first += 1 + (len(prop.token_ids) if prop is not None else 0)
        return verdicts
    max_nodes = max((len(p.token_ids) for p in proposals if p is not None), default=1)
    max_depth = max((p.depth for p in proposals if p is not None), default=0)
    path, accepted, bonus = greedy_tree_verify(target_tokens, *_pack(proposals, target_tokens.device),
                                               max_nodes, max_depth)
    path, accepted, bonus = path.tolist(), accepted.tolist(), bonus.tolist()
    verdicts = []
    for b, prop in enumerate(proposals):
        nodes = path[b][:accepted[b]]
        verdicts.append(Verdict(nodes, [prop.token_ids[n] for n in nodes] + [bonus[b]]))
    return verdicts


def follow_tokens(proposal: DraftProposal | None, token_of_row: Callable[[int, int], int]) -> Verdict:
    """From the root, follow the first child whose token is the one its parent's row gives
    (``token_of_row(row, depth)``: row 0 the root's, row ``k + 1`` node ``k``'s, at
    ``depth`` accepted tokens), until no child has it; that token ends the verdict. The
    walk reads only the rows on its path."""
    kids = children_of(proposal.parents if proposal is not None else [])
    node, accepted = -1, []
    while True:
        token = token_of_row(node + 1, len(accepted))
        child = next((k for k in kids[node] if proposal.token_ids[k] == token), None)
        if child is None:
            return Verdict(accepted, [proposal.token_ids[n] for n in accepted] + [token])
        accepted.append(child)
        node = child


def verify_greedy(target_tokens: list[int], proposal: DraftProposal | None) -> Verdict:
    """``target_tokens[r]``: the argmax of row ``r``."""
    return follow_tokens(proposal, lambda row, depth: target_tokens[row])


def draw(p: torch.Tensor, generator: torch.Generator | None) -> int:
    """A token drawn from the distribution ``p`` ``[vocab]`` with one uniform number of
    ``generator``, by the inverse CDF (:func:`sample_by_uniforms`): a tenth of what
    ``torch.multinomial`` takes over a vocabulary of tens of thousands on a CPU."""
    u = float(torch.rand((), generator=generator, device=p.device))
    return int(sample_by_uniforms(p[None], [u])[0])


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def _without(p: torch.Tensor, x: int) -> torch.Tensor:
    """``norm(max(0, p - q))`` for a one-hot ``q`` at ``x``: ``p`` with ``x`` taken out."""
    r = p.clone()
    r[x] = 0.0
    total = r.sum()
    return r / total if total > 0 else p


def verify_sampled(target_probs, proposal: DraftProposal | None, generator: torch.Generator | None) -> Verdict:
    """Recursive rejection sampling over a chain or tree; output follows the target's rows.

    ``target_probs``: the rows as a ``[rows, vocab]`` tensor or a
    :class:`~specdec.sampler.logits.TargetRows`, which computes only the rows the walk
    reads. A chain on CUDA goes to the batched kernel, which reads every row.
    """
    if proposal is None or not proposal.token_ids:
        return Verdict([], [draw(target_probs[0], generator)])
    if proposal.is_chain and target_probs.device.type == "cuda":
        return _verify_chain(target_probs, proposal, generator)
    kids = children_of(proposal.parents)
    draft = proposal.token_ids
    one_hot = proposal.sibling_sampling == "deterministic" or proposal.draft_probs is None
    node, accepted = -1, []
    while kids[node]:
        p = target_probs[node + 1]
        q_removed: list[int] = []
        chosen = None
        for kid in kids[node]:
            x = draft[kid]
            q = None
            if not one_hot:
                q = proposal.draft_probs[kid].float()
                if q_removed:  # drawn without replacement: earlier siblings are out of q
                    q = q.clone()
                    q[q_removed] = 0.0
                    q = q / q.sum()
            u = float(torch.rand((), generator=generator, device=p.device))
            if u * (1.0 if q is None else float(q[x])) < float(p[x]):
                chosen = kid
                break
            p = _without(p, x) if q is None else _residual(p, q)
            if proposal.sibling_sampling == "without_replacement":
                q_removed.append(x)
        if chosen is None:
            return Verdict(accepted, [draft[n] for n in accepted] + [draw(p, generator)])
        accepted.append(chosen)
        node = chosen
    return Verdict(accepted, [draft[n] for n in accepted] + [draw(target_probs[node + 1], generator)])


_MASK64 = (1 << 64) - 1


def position_uniform(seed: int, position: int) -> float:
    """A uniform number in [0, 1) that depends only on ``seed`` and ``position``
    (SplitMix64 of the two: 53 random bits)."""
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


def sample_by_uniforms(probs: torch.Tensor, uniforms: list[float]) -> torch.Tensor:
    """Row ``r``'s token drawn from ``probs[r]`` by the inverse CDF at ``uniforms[r]``
    (float64 sums in vocabulary order; a zero-probability token is never drawn). On a CPU
    with specdec's kernels built, the sampling kernel draws it with the same sums, so the
    same token, without the float64 copy and cumulative sum of the row."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and cpu_kernel_available():
        return inverse_cdf_cpu(probs, uniforms)
    cdf = probs.double().cumsum(-1)
    at = torch.tensor(uniforms, dtype=torch.float64, device=probs.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, at, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]


def verify_seeded(target_probs, proposal: DraftProposal | None, seed: int, position: int) -> Verdict:
    """Seeded verification (see the module docstring): row 0 draws the token at sequence
    position ``position``, a draft node's row the one after it, each with its position's
    uniform number; the walk follows the first child whose token is the draw
    (:func:`follow_tokens`), so only the rows on its path are computed (``target_probs``
    as in :func:`verify_sampled`)."""
    return follow_tokens(proposal, lambda row, depth: int(
        sample_by_uniforms(target_probs[row][None], [position_uniform(seed, position + depth)])[0]))


def _verify_chain(target_probs, proposal: DraftProposal, generator) -> Verdict:
    """A chain on CUDA: the batched Triton kernel, over every row at once."""
    if not torch.is_tensor(target_probs):
        target_probs = target_probs.all()
    n = len(proposal.token_ids)
    device = target_probs.device
    one_hot = proposal.sibling_sampling == "deterministic" or proposal.draft_probs is None
    q = target_probs[1:] if one_hot else proposal.draft_probs.float()  # q unused when one-hot
    u_accept = torch.rand(n, generator=generator, device=device)
    u_sample = torch.rand(1, generator=generator, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    accepted, token = chain_rejection(target_probs.float().contiguous(), q.contiguous(),
                                      torch.tensor(proposal.token_ids, dtype=torch.int32, device=device),
                                      u_accept, u_sample, zero, zero,
                                      torch.tensor([n], dtype=torch.int32, device=device),
                                      torch.tensor([int(one_hot)], dtype=torch.int32, device=device), n)
    a = int(accepted[0])
    return Verdict(list(range(a)), proposal.token_ids[:a] + [int(token[0])])
