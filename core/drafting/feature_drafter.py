"""Drafters whose module reads the target's features row by row: EAGLE's head, MTP's module.

The draft sequence of a request has one row per target token whose feature is known: row
``i`` reads the target's (fused) feature at position ``i`` and the token at ``i + 1`` and
sits at position ``i``. After each verification the target's features of the root and the
accepted path arrive (``on_draft_verified``); they wait in the request's queue and are
committed in the first draft forward of the next step, whose last output drafts depth 1.
Deeper nodes read their parent's output as feature and are *pending* in the draft runner:
only their descendants see them, and they are dropped when the step's drafting is done,
since their features are the draft's own guesses, not the target's.

A subclass builds its module, calls :meth:`FeatureDrafter.start_runner`, and implements
:meth:`~FeatureDrafter.draft_forward` and :meth:`~FeatureDrafter.head_logits`; it may
override :meth:`~FeatureDrafter.fuse` and :meth:`~FeatureDrafter.expansion` (chains, or
the trees of :class:`~specdec.config.TreeDraftConfig` when the method's config derives
from it). Drafting is one batched forward per depth for all requests together.
"""

from __future__ import annotations

import functools
import logging
from typing import ClassVar

import attrs
import torch

from ..config import TreeDraftConfig
from .chain_stop import ChainStop
from .hookspecs import hookimpl
from .interface import Drafter, DraftProposal
from .runner import DraftInput, DraftRunner
from .tree import StaticTree
from .tree_expansion import ChainExpansion, DynamicExpansion, Expansion, StaticExpansion

log = logging.getLogger(__name__)


#: hidden-state chunks a request keeps unfused (see :class:`FeatureQueue`)
UNFUSED_CHUNKS = 16


@attrs.define
class FeatureQueue:
    """Target rows not yet in the draft cache: their next tokens, and their features:
    ``fused`` blocks first, then ``chunks`` of the target's hidden states as they came
    (each a ``[n, hidden]`` view per layer of the step's states), fused when the request
    drafts, for all drafting requests at once, or by the request once it holds
    :data:`UNFUSED_CHUNKS` of them: a request the adaptive planner keeps from drafting
    costs a list append a step, not a fusion and a copy of all it missed, and keeps
    neither its raw states (EAGLE-3: three times a feature) nor whole steps' states alive
    for long."""

    tokens: list[int] = attrs.Factory(list)
    fused: list[torch.Tensor] = attrs.Factory(list)
    chunks: list[list[torch.Tensor]] = attrs.Factory(list)
    off: bool = False  # the draft cache was lost (pool full): no more drafts for this request

    def keep(self, n: int) -> None:
        """Keep the first ``n`` rows (a recompute from an earlier position)."""
        self.tokens = self.tokens[:n]
        fused, chunks, rows = [], [], 0
        for block in self.fused:
            if rows >= n:
                break
            fused.append(block[:n - rows])
            rows += fused[-1].shape[0]
        for chunk in self.chunks:
            if rows >= n:
                break
            chunks.append([layer[:n - rows] for layer in chunk])
            rows += chunks[-1][0].shape[0]
        self.fused, self.chunks = fused, chunks

    def unfused_rows(self, layer: int) -> list[torch.Tensor]:
        return [chunk[layer] for chunk in self.chunks]


class FeatureDrafter(Drafter):
    #: the key of the request's :class:`FeatureQueue` in ``request.drafter_state``
    state_key: ClassVar[str]
    #: target layers whose hidden states :meth:`fuse` reads (``-1``: the final normalised state)
    layers: list[int] = [-1]
    #: draft-vocabulary index -> target token id of :meth:`head_logits` columns (None: same ids)
    draft_to_target: torch.Tensor | None = None

    def start_runner(self, feature_size: int, num_blocks: int, block_size: int = 16) -> None:
        """Build the draft runner over :meth:`draft_forward` (probing its K/V shapes)."""
        target = self.target
        self.num_blocks = num_blocks
        self.runner = DraftRunner.for_module(self.draft_forward, num_blocks, block_size, target.dtype, target.device,
                                             feature=torch.zeros(1, feature_size, dtype=target.dtype,
                                                                 device=target.device))

    def draft_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, feature: torch.Tensor
                      ) -> torch.Tensor:
        """The module over packed rows (``input_ids``, ``positions`` ``[T]``, ``feature``
        ``[T, F]``), attending through ``meta``: ``[T, F]`` outputs, each the feature of
        its row's children and the input of :meth:`head_logits`."""
        raise NotImplementedError

    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits of outputs ``[n, F]`` over the draft vocabulary."""
        raise NotImplementedError

    def fuse(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The feature of rows computed by the target, from its hidden states of :attr:`layers`."""
        return target_hidden[0]

    def expansion(self, request, depth: int, nodes: int) -> Expansion:
        """How this request's draft grows this step (at most ``depth`` levels, ``nodes``
        nodes) from logits over the draft vocabulary (:attr:`draft_to_target`): as the
        config's :class:`~specdec.config.TreeDraftConfig` options say, a chain where it
        has none; a dynamic tree given no more nodes than levels is the chain (what the
        adaptive planner asks for where the chain pays more)."""
        config, vocab = self.config, self.draft_to_target
        if isinstance(config, TreeDraftConfig) and config.use_dynamic_tree and nodes > depth:
            return DynamicExpansion(config.dynamic_tree_max_topK, depth, nodes, vocab)
        if self.static_tree is not None:
            return StaticExpansion(self.static_tree.trimmed(depth, nodes), vocab)
        return ChainExpansion(min(depth, nodes), request, self.target.vocab_size, vocab,
                              ChainStop(config.min_chain_probability))

    @functools.cached_property
    def static_tree(self) -> StaticTree | None:
        """The config's static tree (:meth:`TreeDraftConfig.static_tree_choices`), built once."""
        choices = self.config.static_tree_choices() if isinstance(self.config, TreeDraftConfig) else None
        return StaticTree.from_choices(choices) if choices else None

    @hookimpl
    def target_hidden_layers(self, target):
        return self.layers

    @hookimpl
    def compile_draft(self, target):
        self.runner.compile()

    @hookimpl
    def on_draft_verified(self, results):
        for r in results:
            if not r.hidden_states:
                continue
            queue: FeatureQueue = r.request.drafter_state.setdefault(self.state_key, FeatureQueue())
            if queue.off:
                continue
            n = next(iter(r.hidden_states.values())).shape[0]
            seq = self.runner.sequence(r.request.request_id)
            have = seq.num_computed + len(queue.tokens)
            if r.start < have:  # recomputed from an earlier position (preemption): roll back
                if r.start <= seq.num_computed:
                    self.runner.truncate(seq, r.start)
                    queue.keep(0)
                else:
                    queue.keep(r.start - seq.num_computed)
            elif r.start > have:
                raise RuntimeError(f"{type(self).__name__}: the draft cache of {r.request.request_id} is missing "
                                   f"positions {have}..{r.start - 1}")
            queue.tokens += r.request.token_ids[r.start + 1:r.start + 1 + n]
            queue.chunks.append([r.hidden_states[layer] for layer in self.layers])
            if len(queue.chunks) >= UNFUSED_CHUNKS:
                queue.fused.append(self._fuse_chunks([queue])[0])
                queue.chunks = []

    def _fuse_chunks(self, queues: list[FeatureQueue]) -> list[torch.Tensor]:
        """The features of the unfused rows of each of ``queues``, one fusion for them all."""
        fused = self.fuse([torch.cat([rows for q in queues for rows in q.unfused_rows(k)])
                           for k in range(len(self.layers))])
        return list(fused.split([sum(chunk[0].shape[0] for chunk in q.chunks) for q in queues]))

    def _features(self, queues: list[FeatureQueue]) -> list[torch.Tensor]:
        """The features of every row the ``queues`` hold."""
        unfused = [q for q in queues if q.chunks]  # none where every row was fused while off
        late = iter(self._fuse_chunks(unfused) if unfused else [])
        return [torch.cat(q.fused + ([next(late)] if q.chunks else [])) for q in queues]

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals: list[DraftProposal | None] = [None] * len(requests)
        active, queues = [], []
        for i, req in enumerate(requests):
            queue: FeatureQueue | None = req.drafter_state.get(self.state_key)
            if queue is None or queue.off or not queue.tokens:
                continue
            active.append(i)
            queues.append(queue)
        if not active:
            return proposals
        inputs = []
        for i, queue, features in zip(active, queues, self._features(queues)):
            seq = self.runner.sequence(requests[i].request_id)
            self.runner.drop_pending(seq)
            inputs.append(DraftInput(seq, queue.tokens, features={"feature": features}))
        outs = self.runner.forward(inputs)
        for queue in queues:
            queue.keep(0)
            if outs is None:
                queue.off = True
        if outs is None:
            log.warning("%s: draft KV cache full (draft_kv_cache_blocks=%d): %d requests continue without drafts",
                        type(self).__name__, self.num_blocks, len(active))
            return proposals
        seq_of = {i: inp.seq for i, inp in zip(active, inputs)}
        grow = {i: self.expansion(requests[i], draft_lens[i], max_nodes[i]) for i in active}
        frontier = {i: ([-1], out) for i, out in zip(active, outs)}  # nodes, their outputs [n, F]
        pending = {i: {} for i in active}  # node -> its pending index in the runner
        while frontier:
            order = list(frontier)
            logits = self.head_logits(torch.cat([frontier[i][1] for i in order])).float()
            step_inputs, next_nodes, row = [], {}, 0
            for i in order:
                nodes, hidden = frontier[i]
                exp = grow[i]
                new = exp.grow(nodes, logits[row:row + len(nodes)])
                out_of = dict(zip(nodes, hidden))
                row += len(nodes)
                if not new:
                    continue
                seq = seq_of[i]
                base = len(seq.pending_parents)
                parents = [pending[i].get(exp.parent(n), -1) for n in new]
                for k, n in enumerate(new):
                    pending[i][n] = base + k
                step_inputs.append(DraftInput(seq, [exp.token(n) for n in new], parents=parents,
                                              features={"feature": torch.stack([out_of[exp.parent(n)] for n in new])},
                                              output_rows=list(range(len(new)))))
                next_nodes[i] = new
            frontier = {}
            if step_inputs:
                outs = self.runner.forward(step_inputs)
                if outs is None:  # pool full: propose what is drafted so far
                    for i in next_nodes:
                        requests[i].drafter_state[self.state_key].off = True
                    break
                frontier = {i: (next_nodes[i], out) for i, out in zip(next_nodes, outs)}
        for i in active:
            proposals[i] = grow[i].proposal()
            self.runner.drop_pending(seq_of[i])
        return proposals

    @hookimpl
    def on_request_finished(self, request):
        self.runner.release(request.request_id)
