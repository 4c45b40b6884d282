"""Medusa drafting: every head reads the target's final normalised hidden state of the last
verified token, once per step for the whole batch, and the static tree takes its nodes'
tokens from the heads' ranked candidates (a node at depth ``d`` with path rank ``r``: the
``r``-th best token of head ``d - 1``; heads do not see the path above them, which is why
the tree is static).

Greedy requests get the tree. Requests that sample get it too, with each node's token
taken deterministically (the core's recursive rejection sampling with one-hot proposals);
where the step's tree is a chain and the request has no seed (``draws_drafts``), its tokens
are drawn from the heads' distributions instead and verified by rejection sampling
against them. Both are lossless.
"""

from __future__ import annotations

import torch

from specdec.plugin_api import (
    DraftProposal,
    FieldError,
    LastStateDrafter,
    drafter_directory,
    hookimpl,
    pick_draft_token,
)

from .checkpoint import SHIPPED_HEADS, load_heads


class MedusaDrafter(LastStateDrafter):
    state_key = "medusa"

    def __init__(self, config, target):
        super().__init__(config, target)
        directory = drafter_directory(config.speculative_model, target, SHIPPED_HEADS, "medusa", "heads")
        heads = load_heads(directory, target)
        usable = config.num_medusa_heads or len(heads)
        if usable > len(heads):
            raise FieldError("speculative_config.num_medusa_heads",
                             f"{usable} heads asked for, but {directory} has {len(heads)}")
        self.tree = config.static_tree()
        if config.medusa_choices is None:  # the default tree, as deep as the heads go
            self.tree = self.tree.trimmed(usable, self.tree.num_nodes)
        elif self.tree.depth > usable:
            raise FieldError("speculative_config.medusa_choices",
                             f"the tree is {self.tree.depth} deep, but {directory} has {usable} usable heads; "
                             f"give a tree at most {usable} deep")
        self.heads = heads.to(target.device, target.dtype).eval().requires_grad_(False)
        if self.heads.shares_lm_head:  # over the tokens they were trained to draft
            self.share_target_head(directory)

    def _logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """``[rows, depth, draft vocab]`` float logits of the first ``depth`` heads."""
        out = self.heads.outputs(hidden, depth)
        return (self.target_head_logits(out) if self.heads.shares_lm_head else out).float()

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals: list[DraftProposal | None] = [None] * len(requests)
        active = self.ready(requests, draft_lens)
        if not active:
            return proposals
        trees = {i: self.tree.trimmed(draft_lens[i], max_nodes[i]) for i in active}
        depth = max(t.depth for t in trees.values())
        logits = self._logits(self.take_states(requests, active), depth)
        top = logits.topk(min(self.tree.max_rank + 1, logits.shape[-1]), dim=-1).indices
        for row, i in enumerate(active):
            req, tree = requests[i], trees[i]
            if req.sampling_params.draws_drafts and tree.max_rank == 0:
                drawn = [pick_draft_token(logits[row, d], req.sampling_params, req.generator, self.target.vocab_size,
                                          self.draft_to_target) for d in range(tree.depth)]
                proposals[i] = DraftProposal(token_ids=[t for t, _ in drawn],
                                             draft_probs=torch.stack([q for _, q in drawn]), sibling_sampling="iid")
                continue
            ranked = [self.to_target_ids(top[row, d]).tolist() for d in range(tree.depth)]
            tokens = tree.fill([ranked[0]] + [ranked[len(p)] if len(p) < tree.depth else [] for p in tree.paths])
            proposals[i] = DraftProposal(token_ids=tokens, parents=list(tree.parents))
        return proposals
