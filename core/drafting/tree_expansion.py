"""A request's draft grown a level at a time: a chain, a static tree or an EAGLE-2 dynamic tree.

Drafters that run one draft forward per depth for the whole batch (EAGLE, MTP: see
:class:`specdec.drafting.feature_drafter.FeatureDrafter`) keep one :class:`Expansion` per request:
each level hands it the draft logits of the nodes it asked for and gets back the new nodes
whose children come next. Logits are over the drafter's vocabulary, which ``vocab`` maps to
target token ids: a reduced draft vocabulary is picked from as it is, never scattered into
the target's (a copy as wide as the target's vocabulary at every level); tokens are target
ids.
"""

from __future__ import annotations

import torch

from ..sampler import pick_draft_token
from .chain_stop import ChainStop
from .interface import TREE_KIND, DraftProposal
from .tree import DynamicTree, StaticTree


class Expansion:
    """Base class: the nodes so far (tokens, parents, draft distributions of sampled chains).

    ``vocab``: the target token id of each draft-logit column (None: the column is the id).
    """

    def __init__(self, vocab: torch.Tensor | None = None):
        self.vocab = vocab
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[torch.Tensor] = []

    def grow(self, nodes: list[int], logits: torch.Tensor) -> list[int]:
        """Add the children of ``nodes`` (-1: the root) from their draft logits
        ``[len(nodes), draft vocab]``; return the new nodes whose children come next."""
        raise NotImplementedError

    def target_ids(self, columns: torch.Tensor) -> list:
        """Target token ids of draft-logit ``columns`` (any shape), as nested lists."""
        return (columns if self.vocab is None else self.vocab[columns]).tolist()

    def token(self, node: int) -> int:
        return self.tokens[node]

    def parent(self, node: int) -> int:
        return self.parents[node]

    def proposal(self) -> DraftProposal | None:
        if not self.tokens:
            return None
        probs = torch.stack(self.probs) if self.probs else None
        return DraftProposal(token_ids=self.tokens, parents=self.parents, draft_probs=probs,
                             sibling_sampling="iid" if probs is not None else "deterministic")


class ChainExpansion(Expansion):
    """The draft's argmax, or a sample of its distribution when the request samples (kept
    over the target's ``vocab_size`` tokens for the rejection sampler); it stops before
    ``depth`` levels where ``stop`` says so."""

    def __init__(self, depth: int, request, vocab_size: int, vocab: torch.Tensor | None = None,
                 stop: ChainStop | None = None):
        super().__init__(vocab)
        self.depth, self.request, self.vocab_size = depth, request, vocab_size
        self.stop = stop if stop is not None else ChainStop()

    def grow(self, nodes, logits):
        req = self.request
        token, q = pick_draft_token(logits[0], req.sampling_params, req.generator, self.vocab_size, self.vocab)
        if q is not None:
            self.probs.append(q)
        self.parents.append(len(self.tokens) - 1)
        self.tokens.append(token)
        grows = len(self.tokens) < self.depth and self.stop.grows_past(logits[0], token, q)
        return [len(self.tokens) - 1] if grows else []


class StaticExpansion(Expansion):
    """A choice-list tree: the child of rank ``r`` is the parent's ``r``-th best token."""

    def __init__(self, tree: StaticTree, vocab: torch.Tensor | None = None):
        super().__init__(vocab)
        self.tree = tree
        self.tokens = [0] * tree.num_nodes
        self.parents = list(tree.parents)
        self.children: dict[int, list[int]] = {-1: []}
        for node, parent in enumerate(tree.parents):
            self.children.setdefault(parent, []).append(node)

    def grow(self, nodes, logits):
        top = self.target_ids(logits.topk(min(self.tree.max_rank + 1, logits.shape[-1]), dim=-1).indices)
        new = []
        for row, node in enumerate(nodes):
            for child in self.children.get(node, []):
                self.tokens[child] = top[row][self.tree.paths[child][-1]]
                new.append(child)
        return [n for n in new if self.children.get(n)]


class DynamicExpansion(Expansion):
    """EAGLE-2: expand the ``top_k`` best frontier nodes, rerank to the node budget."""

    def __init__(self, top_k: int, depth: int, budget: int, vocab: torch.Tensor | None = None):
        super().__init__(vocab)
        self.tree = DynamicTree(top_k)
        self.depth, self.budget, self.levels = depth, budget, 0

    def grow(self, nodes, logits):
        self.tree.expand(torch.log_softmax(logits, dim=-1), self.vocab)
        self.levels += 1
        return list(self.tree.frontier) if self.levels < self.depth else []

    def token(self, node):
        return self.tree.tokens[node]

    def parent(self, node):
        return self.tree.parents[node]

    def proposal(self):
        self.tokens, self.parents, _ = self.tree.rerank(self.budget)
        proposal = super().proposal()
        if proposal is not None:
            proposal.kind = TREE_KIND
        return proposal
