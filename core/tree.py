"""Draft trees: ancestor masks and positions, and the core's default ``build_tree_mask``."""

from __future__ import annotations

import torch

from .drafting import DraftProposal, TreeMask
from .hookspecs import hookimpl


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """``[n+1, n+1]`` bool: token ``i`` (0 = root, node ``k`` = ``k+1``) sees ``j`` iff ``j``
    is ``i`` or one of its ancestors."""
    n = len(parents)
    mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
    mask[:, 0] = True
    for k, p in enumerate(parents):
        row = k + 1
        if p >= 0:
            mask[row] = mask[p + 1]
        mask[row, row] = True
    return mask


def default_tree_mask(proposal: DraftProposal) -> TreeMask:
    if proposal.aux_token_ids:
        raise ValueError("a proposal with aux tokens needs its drafter to implement build_tree_mask")
    n = len(proposal.token_ids)
    if proposal.is_chain:
        mask = torch.ones(n + 1, n + 1, dtype=torch.bool).tril_()
        offsets = torch.arange(n + 1)
    else:
        mask = ancestor_mask(proposal.parents)
        offsets = torch.tensor([0, *proposal.depths()])
    return TreeMask(mask=mask, position_offsets=offsets)


class CoreTreeHooks:
    """The core's own implementation of ``build_tree_mask``; drafters may override it."""

    @hookimpl(trylast=True)
    def build_tree_mask(self, request, proposal: DraftProposal) -> TreeMask:
        return default_tree_mask(proposal)
