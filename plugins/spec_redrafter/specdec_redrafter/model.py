"""The recurrent drafter of the reference (apple/ml-recurrent-drafter), in its state-dict layout.

Given the target's final normalised hidden state ``h`` of the token whose logits gave the
newest token, and the embeddings (the target's own) of the tokens drafted so far, step
``j`` updates a recurrent state and predicts the next token from ``[h; s_j]``::

    s_j = SiLU(rnn_w(e_j) + rnn_u(s_{j-1}))       (rnn: true; s_0 = 0)
    s_j = e_j + s_{j-1}                            (rnn: false: a running sum)
    logits_j = lm_head(input_proj([h; s_j]))       (input_proj only when exit_dim != 2H)

``lm_head`` is ``num_draft_layers`` ResBlocks of width ``exit_dim`` and then a
``Linear(exit_dim, vocab, bias=False)``; keys ``input_proj.*``, ``lm_head.{i}.linear.*``,
``lm_head.{num_draft_layers}.weight``, ``rnn_w.weight``, ``rnn_u.weight/bias``. A variant
without the last projection (``vocab_size`` None, ``exit_dim`` equal to the hidden size)
reads its logits through the target's LM head: the shipped drafter uses it, which keeps
it at 4 MB; a projection of its own to SmolLM2's 49,152 tokens would add 57 MB.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from specdec.plugin_api import ResBlock

#: ``model_type`` of the reference's ``DrafterConfig``.
MODEL_TYPE = "recurrent_drafting_drafter"
#: The reference keeps the 50 best draft tokens before its log-softmax (``warp_logits``).
TOP_K = 50


@attrs.frozen(kw_only=True)
class DrafterShape:
    """The reference config's sizes: ``hidden_size`` (the target's), ``exit_dim``,
    ``num_draft_layers``, ``rnn``, ``vocab_size`` (None: the target's LM head is shared)."""

    hidden_size: int
    exit_dim: int
    num_draft_layers: int
    rnn: bool = True
    vocab_size: int | None = None

    @property
    def shares_lm_head(self) -> bool:
        return self.vocab_size is None


class RecurrentDrafter(nn.Module):
    def __init__(self, shape: DrafterShape):
        super().__init__()
        self.shape = shape
        hidden, exit_dim = shape.hidden_size, shape.exit_dim
        if 2 * hidden != exit_dim:
            self.input_proj = nn.Linear(2 * hidden, exit_dim)
        layers: list[nn.Module] = [ResBlock(exit_dim) for _ in range(shape.num_draft_layers)]
        if shape.vocab_size is not None:
            layers.append(nn.Linear(exit_dim, shape.vocab_size, bias=False))
        self.lm_head = nn.Sequential(*layers)
        if shape.rnn:
            self.rnn_u = nn.Linear(hidden, hidden, bias=True)
            self.rnn_w = nn.Linear(hidden, hidden, bias=False)

    def next_state(self, embedding: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The recurrent state after reading ``embedding`` (the previous draft token's)."""
        if self.shape.rnn:
            return nn.functional.silu(self.rnn_w(embedding) + self.rnn_u(state))
        return embedding + state

    def head(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Logits (or, sharing the target's LM head, the state that head reads) for
        ``[..., hidden]`` target states and recurrent states."""
        x = torch.cat([context, state], dim=-1)
        return self.lm_head(self.input_proj(x) if hasattr(self, "input_proj") else x)


def top_k_scores(logits: torch.Tensor, k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference's scores of each row's ``k`` best tokens: their float32 log-probabilities
    once every other logit is masked out (a log-softmax over the ``k`` alone), and their
    indices, best first; ``[..., k]`` each."""
    values, ids = logits.float().topk(min(k, logits.shape[-1]), dim=-1)
    return values - values.logsumexp(dim=-1, keepdim=True), ids
