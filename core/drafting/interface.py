"""What drafters and the core hand each other: proposals, tree masks, verification results.

A drafter is an object whose methods implement the hooks in :mod:`specdec.drafting.hookspecs`; the
engine registers one instance per ``LLM`` in its own plugin manager. :class:`Drafter` is a
convenient base: it keeps the method's config and the target model.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, Literal

import attrs
import torch

if TYPE_CHECKING:
    from ..config import SpeculativeConfig
    from ..executor.request import Request
    from ..model.target import TargetModel

#: How the children of one tree node were drawn from the draft distribution ``q``.
#: ``deterministic``: chosen without randomness (argmax, top-k, n-gram lookup);
#: ``iid``: each child drawn independently from ``q``; ``without_replacement``: drawn
#: from ``q`` one after another, each excluding the ones drawn before it.
SiblingSampling = Literal["deterministic", "iid", "without_replacement"]


#: :attr:`DraftProposal.kind` of an EAGLE-2 dynamic tree, whose drafter would grow a chain
#: of the same depth when asked for no more nodes than levels: the adaptive planner keeps
#: one acceptance estimate for the trees and one for the chains, to choose between them.
#: Such a tree lists each node's children from the likeliest down, so its chain is the
#: path of first children (:func:`first_child_path`), and verifying the tree also tells
#: how far the chain would have been accepted.
TREE_KIND = "tree"


#: A lookup drafter's proposal (``speculative_config.lookup``) reaches the planner with
#: ``(LOOKUP_KIND, its own kind)`` as :attr:`DraftProposal.kind`: its acceptance estimates
#: stay apart from the method's, whose kinds may be the same values.
LOOKUP_KIND = "lookup"


def is_lookup_kind(kind: Hashable) -> bool:
    """Whether ``kind`` is a lookup drafter's (see :data:`LOOKUP_KIND`)."""
    return isinstance(kind, tuple) and len(kind) == 2 and kind[0] == LOOKUP_KIND


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node of a tree given by its ``parents`` (-1: the root): 1 for children of the root."""
    d: list[int] = []
    for p in parents:
        d.append(1 if p < 0 else d[p] + 1)
    return d


def first_child_path(parents: list[int]) -> list[int]:
    """The nodes reached from the root by taking the first child each time (parents first)."""
    path, first = [], {}
    for node, parent in enumerate(parents):
        first.setdefault(parent, node)
    node = first.get(-1)
    while node is not None:
        path.append(node)
        node = first.get(node)
    return path


@attrs.define
class DraftProposal:
    """Draft tokens for one request: a chain or a tree rooted at its last committed token.

    Attributes:
        token_ids: the draft tokens, one per tree node, parents before children.
        parents: for each node the index of its parent node, ``-1`` for a child of the root.
            ``None`` means a chain (``[-1, 0, 1, ...]``).
        draft_probs: ``[len(token_ids), vocab]``: row ``i`` is the distribution node ``i``
            was drawn from, after the request's logits processing. ``None`` for drafters
            without probabilities (n-gram lookup): the sampler treats ``q`` as one-hot.
        sibling_sampling: how siblings were drawn (see :data:`SiblingSampling`).
        aux_token_ids: tokens forwarded with the tree but never accepted (lookahead's
            Jacobi window); their logits come back in :attr:`StepResult.aux_logits`.
        aux_position_offsets: the position of each aux token relative to the root.
        kind: what sort of draft this is, for the adaptive planner's acceptance estimate
            (ngram: its match length): drafts of one kind share an estimate per draft
            position, so a drafter that knows some of its drafts are better than others
            gets them verified deeper. ``None``: one estimate for all.
    """

    token_ids: list[int]
    parents: list[int] | None = None
    draft_probs: torch.Tensor | None = None
    sibling_sampling: SiblingSampling = "deterministic"
    aux_token_ids: list[int] = attrs.Factory(list)
    aux_position_offsets: list[int] = attrs.Factory(list)
    kind: Hashable = None

    def __attrs_post_init__(self):
        n = len(self.token_ids)
        if self.parents is None:
            self.parents = list(range(-1, n - 1))
        if len(self.parents) != n:
            raise ValueError(f"DraftProposal: {n} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"DraftProposal: node {i} has parent {p}; parents must come before children")
        if self.draft_probs is not None and self.draft_probs.shape[0] != n:
            raise ValueError(f"DraftProposal: draft_probs has {self.draft_probs.shape[0]} rows for {n} tokens")
        if len(self.aux_token_ids) != len(self.aux_position_offsets):
            raise ValueError("DraftProposal: aux_token_ids and aux_position_offsets differ in length")

    def subset(self, keep: list[int]) -> DraftProposal:
        """The proposal restricted to nodes ``keep`` (ascending, closed under ancestors)."""
        where = {n: i for i, n in enumerate(keep)}
        return attrs.evolve(self, token_ids=[self.token_ids[n] for n in keep],
                            parents=[where[self.parents[n]] if self.parents[n] >= 0 else -1 for n in keep],
                            draft_probs=None if self.draft_probs is None else self.draft_probs[keep])

    def up_to_depth(self, depth: int) -> DraftProposal | None:
        """The proposal's nodes down to ``depth``; None for depth 0 (its aux tokens go too)."""
        if depth == 0:
            return None
        return self if depth >= self.depth else self.subset([i for i, d in enumerate(self.depths()) if d <= depth])

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @property
    def verified_as_tree(self) -> bool:
        """Whether the target verifies it as a tree, not a chain: siblings, or aux tokens beside it."""
        return not self.is_chain or bool(self.aux_token_ids)

    @property
    def depth(self) -> int:
        """Depth of the deepest node (0 for a proposal with aux tokens only)."""
        return max(self.depths(), default=0)

    def depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        return node_depths(self.parents)


def proposal_problem(proposal, vocab_size: int) -> str | None:
    """What is wrong with a drafter's proposal for a target of ``vocab_size`` tokens, or
    None. Checked by the engine on every proposal, since a drafter may build one field by
    field after construction."""
    if not isinstance(proposal, DraftProposal):
        return f"expected a DraftProposal or None, got {type(proposal).__name__}"
    bad = [t for t in [*proposal.token_ids, *proposal.aux_token_ids]
           if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        return f"token ids {bad[:3]} are not in the vocabulary 0..{vocab_size - 1}"
    n = len(proposal.token_ids)
    parents = proposal.parents
    if len(parents) != n or any(not -1 <= p < i for i, p in enumerate(parents)):
        return f"parents {list(parents)[:8]} do not describe a tree of {n} nodes, parents first"
    if proposal.draft_probs is not None and tuple(proposal.draft_probs.shape) != (n, vocab_size):
        return f"draft_probs has shape {tuple(proposal.draft_probs.shape)}, expected ({n}, {vocab_size})"
    if len(proposal.aux_token_ids) != len(proposal.aux_position_offsets):
        return "aux_token_ids and aux_position_offsets differ in length"
    try:
        hash(proposal.kind)
    except TypeError:
        return f"kind {proposal.kind!r:.40} is not hashable"
    return None


def tree_mask_problem(mask, num_tokens: int) -> str | None:
    """What is wrong with a ``build_tree_mask`` result for ``num_tokens`` step tokens, or None."""
    if not isinstance(mask, TreeMask):
        return f"expected a TreeMask, got {type(mask).__name__}"
    if tuple(mask.mask.shape) != (num_tokens, num_tokens) or mask.mask.dtype != torch.bool:
        return f"mask is {mask.mask.dtype} {tuple(mask.mask.shape)}, expected bool ({num_tokens}, {num_tokens})"
    if tuple(mask.position_offsets.shape) != (num_tokens,):
        return f"position_offsets has shape {tuple(mask.position_offsets.shape)}, expected ({num_tokens},)"
    if not bool(mask.mask.diagonal().all()) or not bool(mask.mask[:, 0].all()):
        return "every token must see itself and the root"
    return None


@attrs.define
class TreeMask:
    """Attention among the tokens of one verification step of one request.

    The step's tokens are ``[root] + proposal.token_ids + proposal.aux_token_ids``; every
    one of them sees the request's whole committed context, and ``mask[i, j]`` says whether
    token ``i`` also sees step token ``j``. ``position_offsets[i]`` is token ``i``'s position
    minus the root's.
    """

    mask: torch.Tensor  # bool [T, T]
    position_offsets: torch.Tensor  # long [T]


@attrs.define
class StepResult:
    """What one target forward settled for one request; drafters learn from it.

    Attributes:
        request: the request (its ``token_ids`` already include ``new_token_ids``).
        new_token_ids: tokens appended this step: accepted draft tokens then the
            bonus/correction token (for a prefill step: the first generated token; empty
            when a prompt chunk does not finish the prompt).
        proposal: the draft that was verified, or ``None`` (prefill, or no draft).
        accepted_nodes: indices into ``proposal.token_ids`` of the accepted path, root first.
        hidden_states: layer -> ``[n, hidden]`` target hidden states of the tokens whose KV
            was committed this step, in order (the prompt chunk, or root + accepted path).
            Only the layers drafters asked for through ``target_hidden_layers``. The first
            chunk of a prompt whose prefix came from the prefix cache also carries the
            prefix's stored states (from position 0) when a drafter reads every prompt
            token (``reads_prompt_hidden_states``). The tensors are slices of one gather
            for all of the step's results: a drafter keeping states for many steps keeps
            those gathers alive unless it copies or combines what it keeps (as
            :class:`~specdec.drafting.feature_drafter.FeatureQueue` does).
        aux_logits: target logits ``[len(aux_token_ids), vocab]`` of the aux tokens.
        is_prefill: the step computed (part of) the prompt.
        start: the position of the first token ``hidden_states`` covers (a prompt chunk's
            first token, or the root). After a preemption the prompt and the accepted
            output are computed again from 0, so a drafter keeping per-position state
            rebuilds it from there.
    """

    request: Request
    new_token_ids: list[int]
    proposal: DraftProposal | None = None
    accepted_nodes: list[int] = attrs.Factory(list)
    hidden_states: dict[int, torch.Tensor] = attrs.Factory(dict)
    aux_logits: torch.Tensor | None = None
    is_prefill: bool = False
    start: int = 0


class Drafter:
    """Base class for drafting methods. Subclasses implement hooks with ``@hookimpl``.

    ``Drafter(config, target)``: ``config`` is the method's own config class instance,
    ``target`` the :class:`~specdec.model.target.TargetModel` it drafts for.
    """

    def __init__(self, config: SpeculativeConfig, target: TargetModel):
        self.config = config
        self.target = target

    def draft_modules(self) -> list[torch.nn.Module]:
        """The modules this drafter runs, whose linear layers the engine prepacks on CPU
        (``engine.prepack_weights``) or gives w8a8 forwards (``engine.draft_quantization``),
        except those of the target a module shares (a layer-skip draft's layers, a head): by
        default every ``nn.Module`` attribute. Never trained in place once drafting has
        started (the packed copies would go stale)."""
        return [value for value in vars(self).values() if isinstance(value, torch.nn.Module)]
