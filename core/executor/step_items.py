"""The data of one engine step: each request's share of the packed target forward, and
what the step gave each request.

Rows of a step: the forward runs every item's ``tokens`` back to back (item ``i`` from
``row_offset``); its logits hold, first, the rows each item needs to choose tokens
(``num_logits`` from ``logits_from``), then the rows of prompt tokens whose logprobs are
asked (``prompt_rows``, from ``prompt_logits_from``).
"""

from __future__ import annotations

import attrs
import torch

from ..drafting.interface import DraftProposal, TreeMask
from .request import Request


@attrs.define
class StepItem:
    """One request's share of the step's forward: a prompt chunk, or the last token with
    its draft tokens (the root of the draft tree) after them."""

    request: Request
    tokens: list[int]
    start: int  # position (and cache index) of the first token
    positions: torch.Tensor  # [len(tokens)]
    tree_mask: torch.Tensor | None  # [T, T] among the new tokens (None: causal)
    num_logits: int = 0
    proposal: DraftProposal | None = None
    is_prefill: bool = False
    prompt_rows: range = range(0)  # rows of a prefill chunk (from its first) whose prompt logprobs are asked
    row_offset: int = 0  # filled in when the forward is packed
    logits_from: int = 0
    prompt_logits_from: int = 0
    grammar_rows: torch.Tensor | None = None  # the grammar's bitmask rows (root, then nodes) if already computed

    @property
    def num_nodes(self) -> int:
        """Draft nodes verified (0 without a proposal)."""
        return len(self.proposal.token_ids) if self.proposal is not None else 0

    @classmethod
    def prefill(cls, req: Request, n: int) -> StepItem:
        """The next ``n`` prompt tokens of ``req``; the chunk that ends the prompt of a
        request with no output yet asks for the logits of its last token."""
        start = req.num_computed
        done = start + n == req.prefill_target
        prompt_rows = range(0)
        if req.sampling_params.prompt_logprobs is not None:  # positions whose next prompt token is not scored yet
            prompt_rows = range(max(len(req.prompt_logprobs) - start, 0), max(min(n, req.prompt_len - 1 - start), 0))
        return cls(request=req, tokens=req.token_ids[start:start + n], start=start,
                   positions=torch.arange(start, start + n), tree_mask=None,
                   num_logits=1 if done and req.num_output_tokens == 0 and req.sampling_params.max_tokens else 0,
                   is_prefill=True, prompt_rows=prompt_rows)

    @classmethod
    def decode(cls, req: Request, proposal: DraftProposal | None = None, mask: TreeMask | None = None) -> StepItem:
        """The last token of ``req``, with ``proposal``'s tokens verified under ``mask``."""
        root = req.num_computed
        if proposal is None:
            return cls(request=req, tokens=[req.token_ids[-1]], start=root, positions=torch.tensor([root]),
                       tree_mask=None, num_logits=1)
        tokens = [req.token_ids[-1], *proposal.token_ids, *proposal.aux_token_ids]
        return cls(request=req, tokens=tokens, start=root, positions=root + mask.position_offsets,
                   tree_mask=mask.mask, num_logits=len(tokens), proposal=proposal)


@attrs.define
class StepOutput:
    """What one step changed for one request (for streaming)."""

    request: Request
    new_token_ids: list[int]
    finished: bool
