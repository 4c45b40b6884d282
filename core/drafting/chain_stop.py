"""When a chain stops growing: once the drafter's own chance that the target accepts the
whole chain falls below a floor.

A chain drafts one forward per level, and a level pays only if every token before it is
accepted. A drafter trained on the target's distribution estimates that chance by the
product of its tokens' draft probabilities (the argmax's probability for a greedy request,
the drawn token's for a sampled one): the same product EAGLE-2 ranks its tree nodes by.
Stopping where it falls below the floor spares levels the target would rarely reach. The
token that crosses the floor is still verified: dropping a drawn token for its own
probability would skew the draws the rejection sampler corrects, while whether a later
level exists depends only on tokens that, once accepted, are the output.
"""

from __future__ import annotations

import attrs
import torch


@attrs.define
class ChainStop:
    """The running draft probability of one request's chain against ``floor`` (0: never stops)."""

    floor: float = 0.0
    probability: float = 1.0

    def grows_past(self, logits: torch.Tensor, token: int, q: torch.Tensor | None) -> bool:
        """Count the token just drafted from draft ``logits`` (one row); ``q`` is the
        distribution it was drawn from, over the target's ids, or None where it is the
        argmax. Returns whether the chain may grow a level past it."""
        if self.floor <= 0.0:
            return True
        self.probability *= float(q[token]) if q is not None else float(torch.softmax(logits.float(), -1).max())
        return self.probability >= self.floor
