"""Draft trees: ancestor masks and positions, the default verification mask, and the tree
builders every tree-drafting method shares.

* :class:`StaticTree`: a fixed tree from a TensorRT-LLM / Medusa choice list
  (``medusa_choices``, ``eagle_choices``); its mask is built once and cached.
* :class:`DynamicTree`: EAGLE-2's tree, grown by top-k expansion of the best frontier
  nodes by cumulative log-probability, then reranked globally to a node budget.
* :func:`prefix_trie`: candidate continuations (beams, n-grams) merged into one tree.
"""

from __future__ import annotations

import functools

import attrs
import torch

from ..errors import FieldError
from ..kvcache.layout import causal_mask
from .interface import DraftProposal, TreeMask, first_child_path


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
        mask = causal_mask(n + 1)
        offsets = torch.arange(n + 1)
    else:
        mask = _cached_mask(tuple(proposal.parents))
        offsets = torch.tensor([0, *proposal.depths()])
    return TreeMask(mask=mask, position_offsets=offsets)


@functools.lru_cache(maxsize=256)
def _cached_mask(parents: tuple[int, ...]) -> torch.Tensor:
    """Static trees recur every step: their masks are built once (callers must not modify them)."""
    return ancestor_mask(list(parents))


# -- static trees from choice lists -------------------------------------------------------


@attrs.frozen
class StaticTree:
    """A fixed draft tree. Node ``i`` is reached from the root by ``paths[i]``: the rank of
    the candidate taken at each depth (``(0, 1)``: the best token at depth 1, then the
    second best below it). Nodes are ordered by depth, then by path, parents first.
    """

    paths: tuple[tuple[int, ...], ...]
    parents: tuple[int, ...]

    @classmethod
    def from_choices(cls, choices) -> StaticTree:
        """Build from a choice list in either of TensorRT-LLM's notations: every node listed
        (``[[0], [0, 0], [1]]``), or only the unique root-to-leaf paths, prefixes implied
        (``[[0, 0], [1]]``). A ValueError names a bad entry."""
        nodes: set[tuple[int, ...]] = set()
        for i, choice in enumerate(choices):
            if not isinstance(choice, (list, tuple)) or not choice or not all(
                    isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in choice):
                raise ValueError(f"choice {i}: {choice!r} is not a non-empty list of ranks >= 0")
            for d in range(1, len(choice) + 1):
                nodes.add(tuple(choice[:d]))
        if not nodes:
            raise ValueError("the choice list is empty")
        paths = tuple(sorted(nodes, key=lambda p: (len(p), p)))
        index = {p: i for i, p in enumerate(paths)}
        return cls(paths=paths, parents=tuple(index[p[:-1]] if len(p) > 1 else -1 for p in paths))

    @classmethod
    def from_config(cls, choices, max_draft_len: int, field: str) -> StaticTree:
        """A choice list given as config option ``field``: a FieldError when it is not a
        tree or is deeper than ``max_draft_len``."""
        try:
            tree = cls.from_choices(choices)
        except ValueError as exc:
            raise FieldError(field, f"not a tree: {exc}") from None
        if tree.depth > max_draft_len:
            raise FieldError(field, f"the tree is {tree.depth} deep, more than max_draft_len {max_draft_len}; "
                                    "raise max_draft_len")
        return tree

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def num_nodes(self) -> int:
        return len(self.paths)

    @property
    def max_rank(self) -> int:
        """The largest rank used: candidates needed per node (``top_k - 1``)."""
        return max(max(p) for p in self.paths)

    def trimmed(self, depth: int, nodes: int) -> StaticTree:
        """What a step whose planner or budget asks for less than the whole tree verifies:
        the first ``nodes`` nodes no deeper than ``depth`` (nodes come by depth, parents
        first, so the result is a tree); given no more nodes than levels (of the tree's,
        ``depth`` at most), the chain of first children (each level's best rank the tree
        holds), ``nodes`` deep at most: what the adaptive planner asks for where the chain
        pays more than the tree (:attr:`~specdec.config.SpeculativeConfig.chain_or_tree`)."""
        if nodes <= min(depth, self.depth):
            keep = [self.paths[i] for i in first_child_path(list(self.parents))][:nodes]
        else:
            keep = [p for p in self.paths if len(p) <= depth][:nodes]
        return self if len(keep) == len(self.paths) else StaticTree.from_choices([list(p) for p in keep])

    def level(self, depth: int) -> list[int]:
        """Indices of the nodes at ``depth`` (1-based)."""
        return [i for i, p in enumerate(self.paths) if len(p) == depth]

    def mask(self) -> torch.Tensor:
        return _cached_mask(self.parents)

    def fill(self, ranked: list[list[int]]) -> list[int]:
        """Tokens of every node, given for each node's *parent* (the root's entry first,
        then one per node) its candidates best first: ``ranked[0]`` for depth-1 nodes,
        ``ranked[1 + i]`` for the children of node ``i``."""
        return [ranked[0 if parent < 0 else parent + 1][path[-1]] for path, parent in zip(self.paths, self.parents)]


# -- EAGLE-2 dynamic trees ------------------------------------------------------------------


class DynamicTree:
    """A tree grown by expanding the ``top_k`` best frontier nodes, each into its ``top_k``
    most likely children, scored by cumulative log-probability; :meth:`rerank` keeps the
    best nodes overall (EAGLE-2). A child never scores above its parent, so the best nodes
    form a tree; ties are broken towards shallower and earlier nodes, which keeps that so.
    """

    def __init__(self, top_k: int):
        self.top_k = top_k
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.frontier: list[int] = [-1]  # -1: the root

    def expand(self, logprobs: torch.Tensor, token_ids: torch.Tensor | None = None) -> list[int]:
        """Grow one level. ``logprobs[i]`` is the draft's log-distribution below frontier node
        ``i`` (``[len(frontier), vocab]``), its columns the tokens ``token_ids`` (None: the
        column is the token). Adds ``top_k`` children per frontier node and makes the
        ``top_k`` best of them the next frontier; returns the new nodes."""
        base = torch.tensor([0.0 if f < 0 else self.scores[f] for f in self.frontier], dtype=torch.float64)
        top = logprobs.double().topk(self.top_k, dim=-1)
        tokens = (top.indices if token_ids is None else token_ids[top.indices]).tolist()
        new = []
        for row, parent in enumerate(self.frontier):
            for lp, tok in zip(top.values[row].tolist(), tokens[row]):
                self.tokens.append(tok)
                self.parents.append(parent)
                self.scores.append(float(base[row]) + lp)
                new.append(len(self.tokens) - 1)
        self.frontier = sorted(sorted(new, key=lambda n: -self.scores[n])[:self.top_k])
        return new

    def rerank(self, budget: int) -> tuple[list[int], list[int], list[int]]:
        """The ``budget`` best nodes as a tree: (tokens, parents within it, node ids), parents first."""
        order = sorted(range(len(self.tokens)), key=lambda n: (-self.scores[n], n))[:budget]
        keep = set(order)
        for n in order:  # close under ancestors (only ties can break it)
            p = self.parents[n]
            while p >= 0 and p not in keep:
                keep.add(p)
                p = self.parents[p]
        chosen = sorted(keep)
        where = {n: i for i, n in enumerate(chosen)}
        return ([self.tokens[n] for n in chosen], [where.get(self.parents[n], -1) for n in chosen], chosen)


# -- tries of candidate continuations -------------------------------------------------------


def prefix_trie(candidates, depth: int) -> tuple[list[int], list[int]]:
    """Merge candidate continuations (beams, n-grams) into one tree, shared prefixes once.

    Returns (tokens, parents); candidates are cut at ``depth``; earlier candidates come first.
    """
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    for cand in candidates:
        parent = -1
        for tok in list(cand)[:depth]:
            key = (parent, tok)
            if key not in children:
                tokens.append(tok)
                parents.append(parent)
                children[key] = len(tokens) - 1
            parent = children[key]
    return tokens, parents
