"""Logits processing, applied identically to target and draft distributions.

Order (as in vLLM and transformers): repetition penalty, temperature, top-k, top-p, min-p.
"""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams


def apply_repetition_penalty(logits: torch.Tensor, histories: list[list[int]], penalty: float) -> torch.Tensor:
    """CTRL-style penalty: for tokens seen in a row's history, divide positive logits by
    ``penalty`` and multiply negative ones. ``histories[i]`` is row i's prompt + output."""
    if penalty == 1.0:
        return logits
    logits = logits.clone()
    for row, history in enumerate(histories):
        ids = torch.tensor(sorted(set(history)), dtype=torch.long, device=logits.device)
        seen = logits[row, ids]
        logits[row, ids] = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Sampling distribution ``[rows, vocab]`` (float32) after temperature, top-k, top-p, min-p.

    Call it on draft logits too, so that draft and target distributions match in kind.
    Greedy requests (temperature 0) get a one-hot distribution of the argmax.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly before each token
        drop_sorted = before >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def pick_draft_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                     vocab_size: int, draft_to_target: torch.Tensor | None = None) -> tuple[int, torch.Tensor | None]:
    """A draft token from one row of draft logits, as a target token id.

    ``logits`` cover the draft vocabulary: target ids ``draft_to_target`` (``None``: the
    target's first ``len(logits)`` ids). Greedy requests get the argmax and no
    distribution; sampled ones a draw from the processed draft distribution, returned
    with it over the whole target vocabulary (zero outside the draft vocabulary) for
    the rejection sampler.
    """
    if params.greedy:
        best = int(logits.argmax())
        return (best if draft_to_target is None else int(draft_to_target[best])), None
    q_small = probs_from_logits(logits[None], params)[0]
    q = torch.zeros(vocab_size, device=q_small.device)
    if draft_to_target is None:
        q[:q_small.shape[-1]] = q_small
    else:
        q[draft_to_target.to(q.device)] = q_small
    return int(torch.multinomial(q, 1, generator=generator)), q
