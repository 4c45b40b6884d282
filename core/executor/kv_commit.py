"""The commit stage: the KV cache keeps what the step kept, and drafters get its hidden states.

A prompt chunk's KV is kept whole. A decode keeps its root and its accepted path: the
path's KV moves down to the positions right after the root (a tree's accepted nodes are
scattered through the verified block), the rest is freed for the next step to overwrite;
tokens a stop cut off are not kept. Where drafters asked for target hidden states, each
result gets those of its kept rows, and the hidden-state cache keeps them at their KV
slots so that a prefix reused from the prefix cache comes with its states.
"""

from __future__ import annotations

import torch

from ..drafting.interface import StepResult
from ..kvcache import HiddenStateCache, KVCacheManager
from .step_items import StepItem


class KVCommit:
    def __init__(self, kv: KVCacheManager, hidden_cache: HiddenStateCache | None, device: torch.device):
        self.kv = kv
        self.hidden_cache = hidden_cache
        self.device = device

    def commit(self, items: list[StepItem], results: list[StepResult], hidden: dict[int, torch.Tensor]) -> None:
        """Keep each item's kept tokens (after the tokens were appended to the requests)."""
        moves_src, moves_dst = [], []
        kept_rows = []  # per result, the forward's rows whose KV it keeps
        kept_slots = []  # their KV slots, where the hidden cache keeps their states
        prefixes = {}  # result index -> the prefix cache's stored states, put before its chunk's
        keep_states = self.hidden_cache is not None
        for i, (it, res) in enumerate(zip(items, results)):
            req = it.request
            if it.is_prefill:
                self.kv.commit(req, it.start + len(it.tokens))
                kept_rows.append(range(it.row_offset, it.row_offset + len(it.tokens)))
                if keep_states:
                    kept_slots += self.kv.slots(req, it.start, len(it.tokens))
                    if it.start and it.start == req.num_from_prefix_cache:
                        slots = torch.tensor(self.kv.slots(req, 0, it.start), device=self.device)
                        prefixes[i] = self.hidden_cache.read(slots)
                        res.start = 0
                continue
            for k, node in enumerate(res.accepted_nodes, start=1):
                moves_src.extend(self.kv.slots(req, it.start + 1 + node, 1))
                moves_dst.extend(self.kv.slots(req, it.start + k, 1))
            kept_rows.append([it.row_offset, *(it.row_offset + 1 + n for n in res.accepted_nodes)])
            if keep_states:
                kept_slots += self.kv.slots(req, it.start, len(kept_rows[-1]))
        if moves_src:
            self.kv.move(moves_src, moves_dst, self.device)
        for it, res in zip(items, results):
            if not it.is_prefill:  # a stop inside the accepted drafts keeps fewer
                req = it.request
                self.kv.commit(req, min(req.num_computed + 1 + len(res.accepted_nodes), len(req.token_ids) - 1))
        if hidden:
            self._hand_over_hidden(results, hidden, kept_rows, kept_slots, prefixes)

    def _hand_over_hidden(self, results: list[StepResult], hidden: dict[int, torch.Tensor], rows: list,
                          slots: list[int], prefixes: dict[int, dict[int, torch.Tensor]]) -> None:
        """Give each result the hidden states of its kept ``rows`` of the forward, after the
        stored states of its cached prefix where ``prefixes`` has them, and keep them in the
        hidden cache at their KV ``slots``: one gather per layer for the whole step."""
        device = next(iter(hidden.values())).device
        flat = torch.tensor([r for result_rows in rows for r in result_rows], device=device)
        kept = {layer: h.index_select(0, flat) for layer, h in hidden.items()}
        if self.hidden_cache is not None and slots:
            self.hidden_cache.write(torch.tensor(slots, device=device), kept)
        first = 0
        for i, (res, result_rows) in enumerate(zip(results, rows)):
            n = len(result_rows)
            states = {layer: h[first:first + n] for layer, h in kept.items()}
            if i in prefixes:
                states = {layer: torch.cat([prefixes[i][layer], h]) for layer, h in states.items()}
            res.hidden_states = states
            first += n
