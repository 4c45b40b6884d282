"""Medusa heads as the reference builds them, in its state-dict layout.

Head ``k`` is ``Sequential(ResBlock x num_layers, Linear(hidden, vocab, bias=False))``
over the target's final normalised hidden state and predicts the token ``k + 2`` steps
ahead (the target's own LM head predicts the next one). A ResBlock is
``x + SiLU(linear(x))``. The keys are the Medusa-1 file's: ``{k}.{j}.linear.weight/bias``
for the blocks and ``{k}.{num_layers}.weight`` for the projection. A variant without the
projection reads its logits through the target's LM head (``shares_lm_head``): the
shipped heads use it, which keeps them under a megabyte each.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.plugin_api import ResBlock


class MedusaHeads(nn.ModuleList):
    """``num_heads`` heads; ``vocab_size`` None: they share the target's LM head."""

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int, vocab_size: int | None):
        blocks = [[ResBlock(hidden_size, identity_init=True) for _ in range(num_layers)] for _ in range(num_heads)]
        if vocab_size is not None:
            for head in blocks:
                head.append(nn.Linear(hidden_size, vocab_size, bias=False))
        super().__init__(nn.Sequential(*head) for head in blocks)
        self.hidden_size, self.num_layers, self.vocab_size = hidden_size, num_layers, vocab_size

    @property
    def shares_lm_head(self) -> bool:
        return self.vocab_size is None

    def outputs(self, hidden: torch.Tensor, heads: int | None = None) -> torch.Tensor:
        """``[rows, heads, vocab]`` logits of the first ``heads`` heads for ``[rows, hidden]``
        states; ``[rows, heads, hidden]`` states for the target's LM head when they share it."""
        return torch.stack([head(hidden) for head in list(self)[:heads]], dim=1)
