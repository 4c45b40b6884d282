"""The forward stage: every item of a step in one target forward.

The items' tokens are packed back to back, each over its own block table with its own
positions and tree mask; the logits come back only for the rows the step reads (each
item's ``num_logits`` last rows, then the prompt rows whose logprobs are asked), with the
hidden states of every row for the layers drafters asked for.
"""

from __future__ import annotations

import torch

from ..kvcache import KVCacheManager
from ..kvcache.layout import AttentionLayout, SequenceSlice
from ..model.target import ForwardMetadata, TargetModel
from .cuda_graphs import CudaGraphs
from .step_items import StepItem


class PackedForward:
    def __init__(self, target: TargetModel, kv: KVCacheManager, batch_invariant: bool,
                 hidden_layers: frozenset[int], cuda_graphs: CudaGraphs | None = None):
        self.target = target
        self.kv = kv
        self.batch_invariant = batch_invariant
        self.hidden_layers = hidden_layers
        self.cuda_graphs = cuda_graphs

    def __call__(self, items: list[StepItem]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``(logits [rows, vocab], layer -> hidden [tokens, hidden])``; fills in each item's rows."""
        device = self.target.device
        tokens, rows = [], []
        row = 0
        for it in items:
            n = len(it.tokens)
            it.row_offset = row
            it.logits_from = len(rows)
            tokens.extend(it.tokens)
            rows.extend(range(row + n - it.num_logits, row + n))
            row += n
        for it in items:
            if it.prompt_rows:
                it.prompt_logits_from = len(rows)
                rows.extend(it.row_offset + r for r in it.prompt_rows)
        layout = AttentionLayout([SequenceSlice(block_table=it.request.block_table, start=it.start,
                                                positions=it.positions, tree_mask=it.tree_mask) for it in items],
                                 self.kv.block_size, device)
        forward = self.target.forward if self.cuda_graphs is None else self.cuda_graphs.forward
        return forward(torch.tensor(tokens, device=device), layout.query_positions,
                       ForwardMetadata(cache=self.kv.cache, layout=layout, batch_invariant=self.batch_invariant,
                                       hidden_layers=self.hidden_layers),
                       torch.tensor(rows, device=device, dtype=torch.long))
