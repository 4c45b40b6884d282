"""``decoding_type: bigram``: an example third-party drafter.

Options: max_draft_len, smoothing (add-k smoothing of the bigram counts).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import attrs
import torch

from specdec.plugin_api import DecodingType, Drafter, DraftProposal, SpeculativeConfig, hookimpl, in_range


@attrs.frozen(kw_only=True)
class BigramConfig(SpeculativeConfig):
    smoothing: float = attrs.field(default=0.01, validator=in_range(1e-6, 10.0))


class BigramDrafter(Drafter):
    def _table(self, req) -> dict[int, Counter]:
        state = req.drafter_state
        table = state.setdefault("bigrams", defaultdict(Counter))
        seen = state.get("seen", 0)
        ids = req.token_ids
        for a, b in zip(ids[max(seen - 1, 0):-1], ids[max(seen, 1):]):
            table[a][b] += 1
        state["seen"] = len(ids)
        return table

    def _distribution(self, counts: Counter) -> torch.Tensor:
        q = torch.full((self.target.vocab_size,), self.config.smoothing)
        if counts:
            q[list(counts)] += torch.tensor(list(counts.values()), dtype=torch.float)
        return q / q.sum()

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        proposals = []
        for req, k in zip(requests, draft_lens):
            table = self._table(req)
            last = req.token_ids[-1]
            if req.sampling_params.greedy:
                tokens = []
                while len(tokens) < k and table.get(last):
                    last = table[last].most_common(1)[0][0]
                    tokens.append(last)
                proposals.append(DraftProposal(token_ids=tokens) if tokens else None)
                continue
            tokens, rows = [], []
            for _ in range(k):
                q = self._distribution(table.get(last, Counter())).to(req.generator.device)
                last = int(torch.multinomial(q, 1, generator=req.generator))
                tokens.append(last)
                rows.append(q)
            proposals.append(DraftProposal(token_ids=tokens, draft_probs=torch.stack(rows), sibling_sampling="iid"))
        return proposals


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="bigram", config_class=BigramConfig, drafter_class=BigramDrafter,
                          description="example: bigram table learned from the request"))
