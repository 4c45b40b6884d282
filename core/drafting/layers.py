"""Building blocks that several drafters' published layouts share.

Medusa's heads and ReDrafter's LM head are both stacks of the same residual block, with the
same state-dict keys (``linear.weight``, ``linear.bias``), so the block lives here once.
"""

from __future__ import annotations

import torch
from torch import nn


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))``; ``identity_init`` zeroes the weight so that an untrained
    block passes its input through (Medusa's reference starts that way, ReDrafter's not)."""

    def __init__(self, size: int, identity_init: bool = False):
        super().__init__()
        self.linear = nn.Linear(size, size)
        if identity_init:
            nn.init.zeros_(self.linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))
