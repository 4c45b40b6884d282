"""Medusa drafting: every head reads the target's final normalised hidden state of the last
verified token, once per step for the whole batch, and the static tree takes its nodes'
tokens from the heads' ranked candidates (a node at depth ``d`` with path rank ``r``: the
``r``-th best token of head ``d - 1``; heads do not see the path above them, which is why
the tree is static).

Greedy requests get the tree. Requests that sample get it too, with each node's token
taken deterministically (the core's recursive rejection sampling with one-hot proposals);
where the step's tree is a chain, its tokens are drawn from the heads' distributions
instead and verified by rejection sampling against them. Both are lossless.
"""

from __future__ import annotations

import torch

from specdec import Drafter, DraftProposal, hookimpl
from specdec.draft_checkpoint import load_draft_vocab
from specdec.errors import FieldError, ModelLoadError
from specdec.models import EMBEDDED_NAME, resolve_model_dir
from specdec.sampler import pick_draft_token

from .checkpoint import SHIPPED_HEADS, load_heads

STATE = "medusa"


class MedusaDrafter(Drafter):
    def __init__(self, config, target):
        super().__init__(config, target)
        source = config.speculative_model
        if source is None:
            if target.name != EMBEDDED_NAME:
                raise ModelLoadError(f"speculative_config.speculative_model: medusa needs heads trained for "
                                     f"{target.name!r}; give a Medusa checkpoint directory, or train heads with "
                                     "`specdec train medusa --model ...`")
            source = str(SHIPPED_HEADS)
        directory = resolve_model_dir(source)
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
        # Heads sharing the target's LM head read it on the tokens they were trained to draft
        # (all of them when the directory has no drafting vocabulary).
        self.draft_to_target = None
        if self.heads.shares_lm_head:
            weight = target.parts.lm_head.weight.detach()
            self.draft_to_target = load_draft_vocab(directory, target.vocab_size)
            if self.draft_to_target is not None:
                self.draft_to_target = self.draft_to_target.to(target.device)
                weight = weight[self.draft_to_target]
            self._head_weight = weight

    def _logits(self, hidden: torch.Tensor, depth: int) -> torch.Tensor:
        """``[rows, depth, draft vocab]`` float logits of the first ``depth`` heads."""
        out = self.heads.outputs(hidden, depth)
        return (out @ self._head_weight.T if self.heads.shares_lm_head else out).float()

    def _tokens(self, ids: torch.Tensor) -> list[int]:
        return (ids if self.draft_to_target is None else self.draft_to_target[ids]).tolist()

    @hookimpl
    def target_hidden_layers(self, target):
        return [-1]

    @hookimpl
    def on_draft_verified(self, results):
        for r in results:
            if r.new_token_ids and -1 in r.hidden_states:
                # the state whose logits gave the newest token: the heads look one further
                r.request.drafter_state[STATE] = r.hidden_states[-1][-1]

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals: list[DraftProposal | None] = [None] * len(requests)
        active = [i for i, r in enumerate(requests) if STATE in r.drafter_state and draft_lens[i] > 0]
        if not active:
            return proposals
        trees = {i: self.tree.trimmed(draft_lens[i], max_nodes[i]) for i in active}
        depth = max(t.depth for t in trees.values())
        hidden = torch.stack([requests[i].drafter_state.pop(STATE) for i in active])
        logits = self._logits(hidden, depth)
        top = logits.topk(min(self.tree.max_rank + 1, logits.shape[-1]), dim=-1).indices
        for row, i in enumerate(active):
            req, tree = requests[i], trees[i]
            if not req.sampling_params.greedy and tree.max_rank == 0:
                drawn = [pick_draft_token(logits[row, d], req.sampling_params, req.generator, self.target.vocab_size,
                                          self.draft_to_target) for d in range(tree.depth)]
                proposals[i] = DraftProposal(token_ids=[t for t, _ in drawn],
                                             draft_probs=torch.stack([q for _, q in drawn]), sibling_sampling="iid")
                continue
            ranked = [self._tokens(top[row, d]) for d in range(tree.depth)]
            tokens = tree.fill([ranked[0]] + [ranked[len(p)] if len(p) < tree.depth else [] for p in tree.paths])
            proposals[i] = DraftProposal(token_ids=tokens, parents=list(tree.parents))
        return proposals
