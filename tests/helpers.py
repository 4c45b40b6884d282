"""Shared test helpers (importable because pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from specdec import Drafter, DraftProposal, hookimpl
from specdec.testing import first_divergence, near_tie_at  # noqa: F401 - re-exported for the tests


class OracleDrafter(Drafter):
    """Test drafter: mixes the true greedy continuation with random tokens, as chains or trees.

    ``config.options``: ``oracle`` (dict: tuple(prompt) -> full greedy continuation),
    ``tree`` (bool), ``seed``.
    """

    def __init__(self, config, target):
        super().__init__(config, target)
        self.oracle = config.options.get("oracle", {})
        self.tree = config.options.get("tree", False)
        self.gen = torch.Generator().manual_seed(config.options.get("seed", 0))

    def _truth(self, req, k):
        full = self.oracle.get(tuple(req.token_ids[:req.prompt_len]), [])
        done = req.num_output_tokens
        return full[done:done + k]

    def _rand(self):
        return int(torch.randint(0, self.target.vocab_size, (), generator=self.gen))

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        out = []
        for req, k in zip(requests, draft_lens):
            truth = self._truth(req, k)
            keep = int(torch.randint(0, len(truth) + 1, (), generator=self.gen)) if truth else 0
            chain = truth[:keep] + [self._rand() for _ in range(k - keep)]
            if not self.tree:
                out.append(DraftProposal(token_ids=chain))
                continue
            # A tree: a random decoy branch first at each level, then the chain node.
            tokens, parents, parent = [], [], -1
            for tok in chain:
                tokens.append(self._rand())
                parents.append(parent)
                tokens.append(tok)
                parents.append(parent)
                parent = len(tokens) - 1
            out.append(DraftProposal(token_ids=tokens, parents=parents))
        return out
