"""A draft model with its own paged KV cache, for drafters that run a causal LM.

Each request gets a draft sequence: the tokens the draft model has seen and how many of
them are in its cache. Before drafting, a sequence catches up on what the target
accepted since; after verification it rolls back to the longest prefix the target kept.
Built from the same pieces as the target's engine (TargetModel, KVCacheManager,
AttentionLayout), so any architecture the engine runs can draft.
"""

from __future__ import annotations

import attrs
import torch

from .executor.model_runner import ForwardMetadata, TargetModel
from .kernels import AttentionLayout, SequenceSlice
from .kvcache import KVCacheManager, NoFreeBlocks, PagedKVCache


@attrs.define(eq=False)
class DraftSequence:
    token_ids: list[int] = attrs.Factory(list)  # what the draft cache holds, then the pending tokens
    num_computed: int = 0
    block_table: list[int] = attrs.Factory(list)


class DraftModelRunner:
    def __init__(self, model: TargetModel, num_blocks: int, block_size: int = 16):
        self.model = model
        cache = PagedKVCache(model.layer_shapes, num_blocks, block_size, model.dtype, model.device)
        self.kv = KVCacheManager(cache, num_blocks, block_size, enable_prefix_caching=False)
        self.seqs: dict[str, DraftSequence] = {}

    def sync(self, request_id: str, token_ids: list[int]) -> DraftSequence:
        """Point the draft sequence at the request's tokens, keeping the cached common prefix."""
        seq = self.seqs.setdefault(request_id, DraftSequence())
        keep = 0
        limit = min(seq.num_computed, len(token_ids))
        while keep < limit and seq.token_ids[keep] == token_ids[keep]:
            keep += 1
        seq.token_ids = list(token_ids)
        self.kv.commit(seq, keep)
        return seq

    def forward(self, seqs: list[DraftSequence]) -> torch.Tensor | None:
        """Compute every pending token of each sequence; float32 logits of their last tokens.

        Returns None (and frees the sequences' cache) when the pool has no room: drafting
        is skipped for this step, the target is unaffected.
        """
        try:
            for seq in seqs:
                self.kv.reserve(seq, len(seq.token_ids) - seq.num_computed)
        except NoFreeBlocks:
            for seq in seqs:
                self.kv.free(seq)
            return None
        device = self.model.device
        slices, tokens, rows = [], [], []
        for seq in seqs:
            new = seq.token_ids[seq.num_computed:]
            slices.append(SequenceSlice(block_table=seq.block_table, start=seq.num_computed,
                                        positions=torch.arange(seq.num_computed, len(seq.token_ids))))
            tokens += new
            rows.append(len(tokens) - 1)
        layout = AttentionLayout(slices, self.kv.block_size, device)
        logits, _ = self.model.forward(torch.tensor(tokens, device=device), layout.query_positions,
                                       ForwardMetadata(cache=self.kv.cache, layout=layout),
                                       torch.tensor(rows, device=device))
        for seq in seqs:
            self.kv.commit(seq, len(seq.token_ids))
        return logits

    def release(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.kv.free(seq)
