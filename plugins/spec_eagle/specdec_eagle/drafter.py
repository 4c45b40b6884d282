"""EAGLE drafting: the head's rows in the core's draft runner, expanded as a chain, a static
tree (``eagle_choices``) or an EAGLE-2 dynamic tree.

The draft sequence of a request has one row per target token whose feature is known: row
``i`` reads the target's feature at position ``i`` and the token at ``i + 1`` and sits at
position ``i``. After each verification the target's features of the root and the accepted
path arrive (``on_draft_verified``); they wait in the request's queue and are committed in
the first draft forward of the next step, whose last output drafts depth 1. Deeper nodes
read their parent's output as feature and are *pending* in the runner: only their
descendants see them, and they are dropped when the step's drafting is done, since their
features are the draft's own guesses, not the target's.
"""

from __future__ import annotations

import logging

import attrs
import torch

from specdec import Drafter, DraftProposal, hookimpl
from specdec.draft_checkpoint import drafter_directory, load_draft_vocab
from specdec.draft_runner import DraftInput, DraftRunner, draft_attention
from specdec.errors import FieldError
from specdec.sampler import pick_draft_token
from specdec.tree import DynamicTree, StaticTree

from .checkpoint import SHIPPED_HEADS, load_head

log = logging.getLogger(__name__)
STATE = "eagle"


@attrs.define
class _Queue:
    """Target rows not yet in the draft cache: next tokens and fused features."""

    tokens: list[int] = attrs.Factory(list)
    features: torch.Tensor | None = None
    off: bool = False  # the draft cache was lost (pool full): no more drafts for this request


class Expansion:
    """One request's draft tree, grown a level at a time. Logits and tokens are over the
    target's vocabulary (a reduced draft vocabulary is scattered into it first)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.probs: list[torch.Tensor] = []

    def grow(self, nodes: list[int], logits: torch.Tensor) -> list[int]:
        """Add the children of ``nodes`` (-1: the root) from their draft logits
        ``[len(nodes), vocab]``; return the new nodes whose children come next."""
        raise NotImplementedError

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
    """The draft's argmax, or a sample of its distribution when the request samples."""

    def __init__(self, depth: int, request):
        super().__init__()
        self.depth, self.request = depth, request

    def grow(self, nodes, logits):
        req = self.request
        token, q = pick_draft_token(logits[0], req.sampling_params, req.generator, logits.shape[-1])
        if q is not None:
            self.probs.append(q)
        self.parents.append(len(self.tokens) - 1)
        self.tokens.append(token)
        return [len(self.tokens) - 1] if len(self.tokens) < self.depth else []


class StaticExpansion(Expansion):
    """A choice-list tree: the child of rank ``r`` is the parent's ``r``-th best token."""

    def __init__(self, tree: StaticTree):
        super().__init__()
        self.tree = tree
        self.tokens = [0] * tree.num_nodes
        self.parents = list(tree.parents)
        self.children: dict[int, list[int]] = {-1: []}
        for node, parent in enumerate(tree.parents):
            self.children.setdefault(parent, []).append(node)

    def grow(self, nodes, logits):
        top = logits.topk(min(self.tree.max_rank + 1, logits.shape[-1]), dim=-1).indices.tolist()
        new = []
        for row, node in enumerate(nodes):
            for child in self.children.get(node, []):
                self.tokens[child] = top[row][self.tree.paths[child][-1]]
                new.append(child)
        return [n for n in new if self.children.get(n)]


class DynamicExpansion(Expansion):
    """EAGLE-2: expand the ``top_k`` best frontier nodes, rerank to the node budget."""

    def __init__(self, top_k: int, depth: int, budget: int):
        super().__init__()
        self.tree = DynamicTree(top_k)
        self.depth, self.budget, self.levels = depth, budget, 0

    def grow(self, nodes, logits):
        self.tree.expand(torch.log_softmax(logits, dim=-1))
        self.levels += 1
        return list(self.tree.frontier) if self.levels < self.depth else []

    def token(self, node):
        return self.tree.tokens[node]

    def parent(self, node):
        return self.tree.parents[node]

    def proposal(self):
        self.tokens, self.parents, _ = self.tree.rerank(self.budget)
        return super().proposal()


class EagleDrafter(Drafter):
    generation = 1

    def __init__(self, config, target):
        super().__init__(config, target)
        capture = getattr(config, "eagle3_layers_to_capture", None)
        for layer in capture or []:
            if not 0 <= layer < target.num_layers:
                raise FieldError("speculative_config.eagle3_layers_to_capture",
                                 f"layer {layer} is not among the target's layers 0..{target.num_layers - 1}")
        name = "eagle" if self.generation == 1 else "eagle3"
        directory = drafter_directory(config.speculative_model, target, SHIPPED_HEADS[self.generation], name,
                                      "a head")
        head, self.layers = load_head(directory, self.generation, target, capture)
        parts = target.parts
        if head.embed_tokens is None:
            head.embed_tokens = parts.embed_tokens
        if self.generation == 1:
            head.lm_head = parts.lm_head
            vocab = load_draft_vocab(directory, target.vocab_size)  # the tokens it was trained on
            if vocab is not None:
                head.restrict_vocab(vocab)
        self.head = head.to_serving(target.device, target.dtype).eval()
        self.draft_to_target = head.draft_to_target
        self.tree = StaticTree.from_choices(config.eagle_choices) if config.eagle_choices else None
        self._scale = head.layer.self_attn.head_dim ** -0.5
        width = head.config.hidden_size
        self.runner = DraftRunner.for_module(self._forward, config.draft_kv_cache_blocks, 16, target.dtype,
                                             target.device, feature=torch.zeros(1, width, dtype=target.dtype,
                                                                                device=target.device))

    def _forward(self, input_ids, positions, meta, feature):
        emb = self.head.embed_tokens(input_ids)
        return self.head.step(emb, feature, positions,
                              lambda module, q, k, v: draft_attention(module, q, k, v, meta, self._scale))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (-inf outside the draft vocabulary)."""
        logits = self.head.logits(hidden).float()
        if self.draft_to_target is None:
            return logits
        full = logits.new_full((logits.shape[0], self.target.vocab_size), float("-inf"))
        full[:, self.draft_to_target] = logits
        return full

    @hookimpl
    def target_hidden_layers(self, target):
        return self.layers

    @hookimpl
    def on_draft_verified(self, results):
        results = [r for r in results if r.hidden_states]
        if not results:
            return
        fused = self.head.fuse([torch.cat([r.hidden_states[layer] for r in results]) for layer in self.layers])
        first = 0
        for r in results:
            n = next(iter(r.hidden_states.values())).shape[0]
            features, first = fused[first:first + n], first + n
            queue: _Queue = r.request.drafter_state.setdefault(STATE, _Queue())
            if queue.off:
                continue
            seq = self.runner.sequence(r.request.request_id)
            have = seq.num_computed + len(queue.tokens)
            if r.start < have:  # recomputed from an earlier position (preemption): roll back
                if r.start <= seq.num_computed:
                    self.runner.truncate(seq, r.start)
                    queue.tokens, queue.features = [], None
                else:
                    keep = r.start - seq.num_computed
                    queue.tokens, queue.features = queue.tokens[:keep], queue.features[:keep]
            elif r.start > have:
                raise RuntimeError(f"EAGLE draft cache of {r.request.request_id} is missing positions "
                                   f"{have}..{r.start - 1}")
            queue.tokens += r.request.token_ids[r.start + 1:r.start + 1 + n]
            queue.features = features if queue.features is None else torch.cat([queue.features, features])

    def _expansion(self, request, depth: int, nodes: int) -> Expansion:
        config = self.config
        if config.use_dynamic_tree:
            return DynamicExpansion(config.dynamic_tree_max_topK, depth, nodes)
        if self.tree is not None:
            return StaticExpansion(self.tree.trimmed(depth, nodes))
        return ChainExpansion(min(depth, nodes), request)

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals: list[DraftProposal | None] = [None] * len(requests)
        active, inputs = [], []
        for i, req in enumerate(requests):
            queue: _Queue | None = req.drafter_state.get(STATE)
            if queue is None or queue.off or not queue.tokens:
                continue
            seq = self.runner.sequence(req.request_id)
            self.runner.drop_pending(seq)
            active.append(i)
            inputs.append(DraftInput(seq, queue.tokens, features={"feature": queue.features}))
        if not inputs:
            return proposals
        outs = self.runner.forward(inputs)
        for i in active:
            queue = requests[i].drafter_state[STATE]
            queue.tokens, queue.features = [], None
            if outs is None:
                queue.off = True
        if outs is None:
            log.warning("EAGLE draft KV cache full (draft_kv_cache_blocks=%d): %d requests continue without drafts",
                        self.config.draft_kv_cache_blocks, len(active))
            return proposals
        seq_of = {i: inp.seq for i, inp in zip(active, inputs)}
        grow = {i: self._expansion(requests[i], draft_lens[i], max_nodes[i]) for i in active}
        frontier = {i: ([-1], out) for i, out in zip(active, outs)}  # nodes, their outputs [n, H]
        pending = {i: {} for i in active}  # node -> its pending index in the runner
        while frontier:
            order = list(frontier)
            logits = self._logits(torch.cat([frontier[i][1] for i in order]))
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
                        requests[i].drafter_state[STATE].off = True
                    break
                frontier = {i: (next_nodes[i], out) for i, out in zip(next_nodes, outs)}
        for i in active:
            proposals[i] = grow[i].proposal()
            self.runner.drop_pending(seq_of[i])
        return proposals

    @hookimpl
    def on_request_finished(self, request):
        self.runner.release(request.request_id)


class Eagle3Drafter(EagleDrafter):
    generation = 3
