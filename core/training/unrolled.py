"""Training-time test: a draft module's steps unrolled over every position of a batch at once.

EAGLE's heads and MTP modules draft at inference by feeding each step's output back as the
next step's feature. Training unrolls ``steps`` such draft steps over all positions in one
pass each: step ``j`` reads the features step ``j - 1`` produced (step 0 reads the
target's), attends as the same step does at inference (:func:`unrolled_attention`), and
learns the target's own next-token distribution ``j + 1`` tokens further on (soft targets
from its stored final features), with loss weight ``decay ** j``.

Hand-written layers call the ``attend`` function directly; transformers decoder layers
(an MTP block of the target's architecture) reach it through the attention implementation
:data:`UNROLLED_ATTENTION`, given ``unrolled=attend`` as a keyword of the layer call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from ..kvcache.layout import causal_mask
from .method import TrainBatch

#: ``attend(module, q [B, heads, L, d], k [B, kv, L, d], v [B, kv, L, dv], scale=None) -> [B, L, heads, dv]``
Attend = Callable[..., torch.Tensor]
#: The transformers attention implementation that routes a layer's attention to ``unrolled=``.
UNROLLED_ATTENTION = "specdec_unrolled"


def shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``out[:, i] = x[:, i + k]``, zero (False) past the end."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


def unrolled_attention(valid: torch.Tensor) -> tuple[Attend, Callable[[], None]]:
    """Training-time attention for unrolled draft steps over a batch ``[B, L]``.

    Step 0 is causal over the batch's rows (``valid``: ``[B, L]`` bool, padding False).
    At step ``j`` the row of position ``i`` stands for the draft's ``j``-th token after
    position ``i``: like at inference it sees step 0's rows up to ``i`` and its own rows of
    steps ``1..j``, nothing else. Returns ``(attend, next_step)``: call ``next_step()``
    between steps; ``attend`` keeps the keys of every step so far.
    """
    keys: list[tuple[torch.Tensor, torch.Tensor]] = []
    L = valid.shape[1]
    causal = causal_mask(L).to(valid.device)
    mask0 = causal[None] & valid[:, None, :]  # [B, L, L]

    def attend(module, q, k, v, scale=None):
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scale = scale if scale is not None else q.shape[-1] ** -0.5
        current = keys + [(k, v)]
        k0, v0 = current[0]
        s0 = (q @ k0.transpose(-1, -2)) * scale
        s0 = s0.masked_fill(~mask0[:, None], float("-inf"))
        diag = [((q * kj).sum(-1) * scale)[..., None] for kj, _ in current[1:]]
        probs = torch.softmax(torch.cat([s0, *diag], dim=-1), dim=-1)
        out = probs[..., :L] @ v0
        for j, (_, vj) in enumerate(current[1:]):
            out = out + probs[..., L + j:L + j + 1] * vj
        attend.pending = (k, v)
        return out.transpose(1, 2)  # [B, L, h, dv]

    def next_step():
        keys.append(attend.pending)

    return attend, next_step


def _unrolled_interface(module, query, key, value, attention_mask, scaling=None, dropout=0.0, unrolled=None,
                        **kwargs):
    if unrolled is None:
        raise RuntimeError(f"the {UNROLLED_ATTENTION} attention needs unrolled=attend (from unrolled_attention)")
    return unrolled(module, query, key, value, scaling), None


AttentionInterface.register(UNROLLED_ATTENTION, _unrolled_interface)


def training_time_test(step: Callable[..., torch.Tensor], emb: torch.Tensor, feature: torch.Tensor,
                       batch: TrainBatch, steps: int, decay: float,
                       draft_logits: Callable[[torch.Tensor], torch.Tensor], teacher_weight: torch.Tensor,
                       feature_weight: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """The unrolled loss of one batch.

    ``step(emb [B, L, E], feature [B, L, F], positions [L], attend) -> [B, L, F]`` is one
    draft step; ``emb`` the embeddings of the batch's tokens; ``feature`` the fused target
    features of its rows. Step ``j``'s row ``i`` predicts the token at ``i + j + 2``: its
    loss is the cross-entropy of ``draft_logits(output)`` against the softmax of the
    target's final feature at ``i + j + 1`` times ``teacher_weight`` (the target's LM head
    rows of the draft vocabulary), plus ``feature_weight`` times the smooth L1 distance of
    the output to that feature. Metrics: ``acc{j}``, how often the draft's argmax is the
    target's.
    """
    valid = batch.attention_mask.bool()
    attend, next_step = unrolled_attention(valid)
    positions = torch.arange(valid.shape[1], device=valid.device)
    total, metrics = 0.0, {}
    for j in range(steps):
        hidden = step(shift(emb, j + 1), feature, positions + j, attend)
        next_step()
        mask = shift(batch.loss_mask, j + 1)
        if not mask.any():
            break
        goal = shift(batch.features[-1], j + 1)[mask]
        with torch.no_grad():
            teacher = torch.softmax(goal @ teacher_weight.T, dim=-1)
        draft = draft_logits(hidden[mask]).float()
        step_loss = -(teacher * torch.log_softmax(draft, dim=-1)).sum(-1).mean()
        if feature_weight:
            step_loss = step_loss + feature_weight * F.smooth_l1_loss(hidden[mask].float(), goal)
        total = total + decay ** j * step_loss
        metrics[f"acc{j}"] = float((draft.argmax(-1) == teacher.argmax(-1)).float().mean())
        feature = hidden
    return total, metrics
