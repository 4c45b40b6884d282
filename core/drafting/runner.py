"""The draft side's runner: any draft module, batched over requests, over its own paged KV cache.

A *draft module* is whatever a method drafts with: a small causal LM (draft_target), one
decoder layer over fused target features (EAGLE), an MTP block. The runner gives it what
the target has: a paged KV cache with rollback, packed forwards of many requests at once
(one forward per draft depth for the whole batch), positions and tree masks per request,
and outputs for every row the caller asks for.

Two ways to keep a draft cache in step with a request:

* chains, committed as they are drafted: :meth:`DraftRunner.sync` points the sequence at
  the request's tokens and keeps the longest common prefix, rolling back the rest;
* trees, expanded level by level: each level's tokens are *pending* (in the cache, seen
  only by their descendants through the mask the caller gives); after verification
  :meth:`DraftRunner.keep_path` moves the accepted path's K/V into place, the same
  compaction the target's cache does, and drops the rest.

The module is called as ``forward(input_ids [T], positions [T], meta, **features)`` and
returns hidden states ``[T, H]``; ``features`` are per-token tensors ``[T, F]`` packed
across requests (EAGLE's fused target states, say). Its attention layers must use
specdec's attention and hand it ``meta`` as it came (the step's metadata, or what a
compiled graph attends with): transformers layers through their ``attn_implementation``
and the ``specdec`` keyword (:func:`causal_lm_forward`), hand-written layers by calling
:func:`draft_attention`.

Where the target runs compiled, so does the module (:meth:`DraftRunner.compile`): a draft
level is a handful of small products whose eager Python costs more than their arithmetic.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import torch

from ..kernels import cpu_kernel_fits
from ..kvcache import KVCacheManager, NoFreeBlocks, PagedKVCache
from ..kvcache.layout import AttentionLayout, SequenceSlice
from ..model.target import (
    ATTENTION_NAME,
    CPP_WRAPPER_OPTIONS,
    ForwardMetadata,
    KeyRows,
    compile_unguarded,
    compiled_step,
    paged_attention_forward,
    probe_kv_layers,
)
from .interface import node_depths
from .tree import ancestor_mask

log = logging.getLogger(__name__)

DraftForward = Callable[..., torch.Tensor]

@attrs.define(eq=False)
class DraftSequence:
    """One request's draft cache: ``num_computed`` committed tokens of ``token_ids``, then
    ``len(pending_parents)`` pending tree nodes (parent indices among the pending, -1 for
    a child of the last committed token), at ``pending_positions``."""

    token_ids: list[int] = attrs.Factory(list)
    num_computed: int = 0
    block_table: list[int] = attrs.Factory(list)
    pending_parents: list[int] = attrs.Factory(list)
    pending_positions: list[int] = attrs.Factory(list)


@attrs.define
class DraftInput:
    """One sequence's share of one draft forward.

    Attributes:
        seq: the sequence.
        token_ids: the new tokens.
        positions: their positions (default: right after the committed tokens, in order).
        parents: ``None``: the tokens extend the sequence causally and are committed.
            Otherwise they are new pending tree nodes: each one's parent is an index
            into the sequence's pending nodes (old ones first, then these), ``-1`` for a
            child of the last committed token; each sees only its ancestors.
        features: name -> ``[n, F]`` per-token inputs handed to the module.
        output_rows: which of the new tokens to return outputs for (default: the last).
    """

    seq: DraftSequence
    token_ids: list[int]
    positions: list[int] | None = None
    parents: list[int] | None = None
    features: dict[str, torch.Tensor] = attrs.Factory(dict)
    output_rows: list[int] | None = None


class DraftRunner:
    """Runs a draft module over its own paged KV cache, batched over requests."""

    def __init__(self, forward: DraftForward, layer_shapes: list[tuple[int, int, int]], num_blocks: int,
                 block_size: int, dtype: torch.dtype, device: torch.device,
                 feature_examples: dict[str, torch.Tensor] | None = None):
        self.module_forward = forward
        self.device = device
        cache = PagedKVCache(layer_shapes, num_blocks, block_size, dtype, device)
        self.kv = KVCacheManager(cache, num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, DraftSequence] = {}
        #: ``[1, F]`` examples of the module's per-token inputs (what :meth:`compile` warms up with)
        self.feature_examples = feature_examples or {}
        self._compiled = None
        self._key_rows = False  # the compiled module attends over key rows on the CPU kernel

    @classmethod
    def for_module(cls, forward: DraftForward, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, **features) -> DraftRunner:
        """Probe the module's K/V shapes with a one-token forward (``features``: ``[1, F]``
        examples of its per-token inputs) and build its runner."""
        layers = probe_kv_layers(lambda meta: forward(torch.zeros(1, dtype=torch.long, device=device),
                                                      torch.zeros(1, dtype=torch.long, device=device), meta,
                                                      **features), type(forward).__name__)
        return cls(forward, [layer[:3] for layer in layers], num_blocks, block_size, dtype, device, features)

    def compile(self) -> None:
        """Run the module through ``torch.compile`` from now on: a graph for one row and one
        for two or more (sizes dynamic), both compiled here on a scratch sequence, not on
        the first requests. Its attention is traced into the graph on the CPU kernel,
        every token over its own row of keys (:attr:`AttentionLayout.token_key_rows`,
        chains, trees and pending nodes alike), else it is the core's opaque
        paged-attention operator (the step's layout read from
        :data:`~specdec.model.target.compiled_step`). Its numerics may differ from the
        eager ones in the last bits: drafts may change, the output never does."""
        forward = self.module_forward

        def draft_step(input_ids, positions, attend, features):
            return forward(input_ids, positions, attend, **features)

        self._compiled = compile_unguarded(draft_step, **CPP_WRAPPER_OPTIONS)
        cache = self.kv.cache
        self._key_rows = self.device.type == "cpu" and all(cpu_kernel_fits(k, k, v)
                                                            for k, v in zip(cache.keys, cache.values))
        scratch = DraftSequence()
        try:
            for rows in (2, 1):
                self.forward([DraftInput(scratch, [0] * rows, features={k: v.repeat(rows, 1)
                                                                        for k, v in self.feature_examples.items()})])
        except Exception as exc:  # noqa: BLE001 - a module torch.compile cannot take drafts eagerly
            log.warning("the draft module did not compile (%s: %s); it runs eagerly", type(exc).__name__, exc)
            self._compiled, self._key_rows = None, False
        finally:
            self.kv.free(scratch)

    def sequence(self, request_id: str) -> DraftSequence:
        return self.seqs.setdefault(request_id, DraftSequence())

    def sync(self, request_id: str, token_ids: list[int]) -> DraftSequence:
        """Point a chain-drafted sequence at the request's tokens, keeping the cached common prefix."""
        seq = self.sequence(request_id)
        self.drop_pending(seq)
        keep = 0
        limit = min(seq.num_computed, len(token_ids) - 1)  # the last token is always run: its output drafts
        while keep < limit and seq.token_ids[keep] == token_ids[keep]:
            keep += 1
        seq.token_ids = list(token_ids)
        self.kv.commit(seq, keep)
        return seq

    @torch.inference_mode()
    def forward(self, inputs: list[DraftInput]) -> list[torch.Tensor] | None:
        """One packed forward of every input's new tokens; per input, ``[rows, H]`` outputs.

        Returns None (and frees the sequences' caches) when the pool has no room: drafting
        is skipped this step, the target is unaffected.
        """
        try:
            for inp in inputs:
                seq = inp.seq
                self.kv.reserve(seq, len(seq.pending_parents) + len(inp.token_ids))
        except NoFreeBlocks:
            for inp in inputs:
                self.kv.free(inp.seq)
                inp.seq.pending_parents, inp.seq.pending_positions = [], []
            return None
        slices, tokens, rows = [], [], []
        features: dict[str, list[torch.Tensor]] = {}
        for inp in inputs:
            slices.append(self._slice(inp))
            first = len(tokens)
            tokens += inp.token_ids
            rows.append([first + r for r in (inp.output_rows if inp.output_rows is not None
                                              else [len(inp.token_ids) - 1])])
            for name, value in inp.features.items():
                features.setdefault(name, []).append(value)
        layout = AttentionLayout(slices, self.kv.block_size, self.device)
        hidden = self._module(torch.tensor(tokens, device=self.device), layout.query_positions,
                              ForwardMetadata(cache=self.kv.cache, layout=layout),
                              {k: torch.cat(v) for k, v in features.items()})
        for inp, slc in zip(inputs, slices):
            self._advance(inp, slc.positions.tolist())
        return [hidden[torch.tensor(r, device=hidden.device)] for r in rows]

    def _module(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                features: dict[str, torch.Tensor]) -> torch.Tensor:
        if self._compiled is None:
            return self.module_forward(input_ids, positions, meta, **features)
        positions = positions.clone()  # an inference-mode copy, as every other input
        attend = self._step_rows(meta, positions) if self._key_rows else None
        # sizes of tokens dynamic past one (a graph of one token is compiled apart), of keys always
        dynamic = [attend.key_slots, attend.key_pos] if attend is not None else []
        if len(input_ids) > 1:
            dynamic += [input_ids, positions, *features.values(), *(attend.row_tensors() if attend is not None else ())]
        for tensor in dynamic:
            torch._dynamo.mark_dynamic(tensor, 0)
        compiled_step.meta = meta
        try:
            return self._compiled(input_ids, positions, attend, features)
        finally:
            compiled_step.meta = None

    @staticmethod
    def _step_rows(meta: ForwardMetadata, positions: torch.Tensor) -> KeyRows:
        rows = meta.layout.token_key_rows
        return KeyRows(tuple(meta.cache.keys), tuple(meta.cache.values), rows["new_slots"], rows["slots"],
                       rows["key_pos"], rows["offset"], rows["count"], positions)

    def _slice(self, inp: DraftInput) -> SequenceSlice:
        seq = inp.seq
        num_pending, n = len(seq.pending_parents), len(inp.token_ids)
        start = seq.num_computed + num_pending
        if inp.parents is None:
            if num_pending:
                raise ValueError("a sequence with pending tree nodes takes only tree inputs; call keep_path "
                                 "or drop_pending first")
            positions = inp.positions if inp.positions is not None else list(range(start, start + n))
            return SequenceSlice(block_table=seq.block_table, start=start, positions=torch.tensor(positions))
        parents = seq.pending_parents + list(inp.parents)
        # The tree's root is the last committed token: row/column 0 of the ancestor mask.
        sees = ancestor_mask(parents)[1 + num_pending:, 1:]
        if inp.positions is not None:
            positions = inp.positions
        else:
            positions = [seq.num_computed - 1 + d for d in node_depths(parents)[num_pending:]]
        return SequenceSlice(block_table=seq.block_table, start=start, positions=torch.tensor(positions),
                             tree_mask=sees[:, num_pending:],
                             pending_mask=sees[:, :num_pending] if num_pending else None,
                             pending_positions=torch.tensor(seq.pending_positions) if num_pending else None)

    def _advance(self, inp: DraftInput, positions: list[int]) -> None:
        seq = inp.seq
        if inp.parents is None:
            start = seq.num_computed
            seq.token_ids[start:start + len(inp.token_ids)] = inp.token_ids
            self.kv.commit(seq, start + len(inp.token_ids))
        else:
            seq.pending_parents += list(inp.parents)
            seq.pending_positions += positions

    def keep_path(self, seq: DraftSequence, path: list[int], token_ids: list[int]) -> None:
        """Commit the pending nodes ``path`` (root-first indices) with their ``token_ids``;
        drop the other pending nodes."""
        first = seq.num_computed
        src = self.kv.slots(seq, first, len(seq.pending_parents))
        self.kv.move([src[node] for node in path], self.kv.slots(seq, first, len(path)), self.device)
        del seq.token_ids[first:]
        seq.token_ids += token_ids
        seq.pending_parents, seq.pending_positions = [], []
        self.kv.commit(seq, first + len(path))

    def truncate(self, seq: DraftSequence, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` committed tokens (rollback), no pending nodes."""
        seq.pending_parents, seq.pending_positions = [], []
        num_tokens = min(num_tokens, seq.num_computed)
        del seq.token_ids[num_tokens:]
        self.kv.commit(seq, num_tokens)

    def drop_pending(self, seq: DraftSequence) -> None:
        seq.pending_parents, seq.pending_positions = [], []
        self.kv.commit(seq, seq.num_computed)

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)


def draft_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    meta: ForwardMetadata | KeyRows | None, scale: float) -> torch.Tensor:
    """Attention of a hand-written draft layer over the runner's cache: writes the new
    tokens' K/V and attends with the step's masks (``meta``: what the runner hands the
    module, whether it runs eagerly or compiled). ``query`` ``[heads, T, dim]``, ``key`` and
    ``value`` ``[kv_heads, T, dim]`` after rotary; ``module.layer_idx`` names the cache layer.
    Returns ``[T, heads, value_dim]``."""
    out, _ = paged_attention_forward(module, query[None], key[None], value[None], None, scaling=scale, specdec=meta)
    return out[0]


def causal_lm_forward(model) -> DraftForward:
    """The draft-module forward of a transformers causal LM: its decoder and final norm
    (the LM head is left to the caller, who may read a reduced vocabulary)."""
    model.set_attn_implementation(ATTENTION_NAME)
    base = getattr(model, model.base_model_prefix)

    def forward(input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata) -> torch.Tensor:
        out = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False, specdec=meta)
        return out.last_hidden_state[0]

    return forward
