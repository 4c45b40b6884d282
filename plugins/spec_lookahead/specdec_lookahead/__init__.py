"""Lookahead decoding (Fu et al., 2024): Jacobi iterations feed an n-gram pool, verified in one pass.

Every step the target runs, beside the request's last token, two branches in one forward:

* the lookahead branch: a window of ``N - 1`` levels by ``W`` columns. Level ``j`` column
  ``i`` stands at position root + ``i + j + 1`` and sees the root, level 0 up to column
  ``i`` and the levels below it in column ``i``: one Jacobi iteration for every column. The
  target's argmax at the top level gives each column its next token; the column's tokens
  plus that prediction form an ``N``-gram for the pool, and the window moves up one level.
* the verification branch: up to ``G`` pool n-grams that start with the last token, merged
  into a trie and verified by the core sampler (greedy, or rejection sampling with one-hot
  drafts, so the output is exact either way).

Options (TensorRT-LLM's names; defaults the best measured on the embedded model):
    max_window_size [5] (W), max_ngram_size [4] (N), max_verification_set_size [5] (G),
    max_draft_len [3]: the verified depth, N - 1 for whole n-grams.
"""

from __future__ import annotations

import random
import zlib

import attrs
import torch

from specdec.plugin_api import (
    DecodingType,
    Drafter,
    DraftProposal,
    SpeculativeConfig,
    TreeMask,
    ancestor_mask,
    hookimpl,
    in_range,
    prefix_trie,
)


@attrs.frozen(kw_only=True)
class LookaheadConfig(SpeculativeConfig):
    max_draft_len: int = attrs.field(default=3, validator=in_range(1, 64))  # N - 1: a whole n-gram
    max_window_size: int = attrs.field(default=5, validator=in_range(1, 64))
    max_ngram_size: int = attrs.field(default=4, validator=in_range(2, 16))
    max_verification_set_size: int = attrs.field(default=5, validator=in_range(1, 64))

    def node_budget(self) -> int:
        """The trie of ``G`` n-grams: up to ``G * max_draft_len`` nodes."""
        return self.max_total_draft_tokens or self.max_verification_set_size * self.max_draft_len


class LookaheadState:
    """One request's Jacobi window and n-gram pool."""

    def __init__(self, tokens: list[int], window: int, ngram: int, seed: int):
        pick = random.Random(seed)
        self.levels = [[pick.choice(tokens) for _ in range(window)] for _ in range(ngram - 1)]
        self.pool: dict[int, list[tuple[int, ...]]] = {}

    def add(self, gram: tuple[int, ...], keep: int) -> None:
        grams = self.pool.setdefault(gram[0], [])
        if gram[1:] in grams:
            grams.remove(gram[1:])
        grams.append(gram[1:])
        del grams[:-keep]


class LookaheadDrafter(Drafter):
    def _state(self, req) -> LookaheadState:
        if "lookahead" not in req.drafter_state:
            req.drafter_state["lookahead"] = LookaheadState(req.token_ids, self.config.max_window_size,
                                                            self.config.max_ngram_size,
                                                            zlib.crc32(req.request_id.encode()))
        return req.drafter_state["lookahead"]

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        proposals = []
        for req, k in zip(requests, draft_lens):
            state = self._state(req)
            candidates = state.pool.get(req.token_ids[-1], [])[-self.config.max_verification_set_size:]
            tokens, parents = prefix_trie(reversed(candidates), k)
            window = self.config.max_window_size
            aux = [tok for level in state.levels for tok in level]
            offsets = [i + j + 1 for j in range(len(state.levels)) for i in range(window)]
            proposals.append(DraftProposal(token_ids=tokens, parents=parents, aux_token_ids=aux,
                                           aux_position_offsets=offsets))
        return proposals

    @hookimpl
    def build_tree_mask(self, request, proposal):
        n, window = len(proposal.token_ids), self.config.max_window_size
        levels = len(proposal.aux_token_ids) // window
        size = 1 + n + levels * window
        mask = torch.zeros(size, size, dtype=torch.bool)
        mask[:1 + n, :1 + n] = ancestor_mask(proposal.parents)
        first = 1 + n
        for j in range(levels):
            for i in range(window):
                row = first + j * window + i
                mask[row, 0] = True
                mask[row, first:first + i + 1] = True  # level 0 up to column i
                for below in range(1, j + 1):
                    mask[row, first + below * window + i] = True  # column i of the levels up to j
        offsets = torch.tensor([0, *proposal.depths(), *proposal.aux_position_offsets])
        return TreeMask(mask=mask, position_offsets=offsets)

    @hookimpl
    def on_draft_verified(self, results):
        window, keep = self.config.max_window_size, self.config.max_verification_set_size
        for result in results:
            if result.aux_logits is None:
                continue
            state = self._state(result.request)
            top = result.aux_logits[-window:].argmax(-1).tolist()  # the top level's next tokens
            for i in range(window):
                state.add(tuple(level[i] for level in state.levels) + (top[i],), keep)
            state.levels = state.levels[1:] + [top]

    @hookimpl
    def on_request_finished(self, request):
        request.drafter_state.pop("lookahead", None)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="lookahead", aliases=("Lookahead",), config_class=LookaheadConfig,
                          drafter_class=LookaheadDrafter,
                          description="lookahead decoding: Jacobi window and n-gram pool"))
