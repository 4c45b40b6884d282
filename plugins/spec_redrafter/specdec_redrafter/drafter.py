"""ReDrafter drafting: a beam search over the recurrent drafter, batched over requests (one
drafter step per depth for the whole batch, ``requests x beam_width`` rows), whose beams
are merged into a prefix tree by the core and verified in one target forward.

Greedy and seeded requests get the beam search of the reference: every beam starts from
the token the target just produced, the ``beam_width`` best continuations by cumulative
log-probability (top-50 scores, as the reference) survive each step, and the finished
beams (best first) become the tree, shared prefixes once. Requests that sample without a
seed draw ``beam_width`` beams independently from the drafter's distribution instead,
each its own chain below the root; the core verifies them by recursive rejection
sampling over i.i.d. siblings, so sampled output keeps the target's distribution (a beam
search's deterministic picks would be lossless too, but accept less often under
rejection sampling; a seeded request keeps only drafts equal to the target's own draw).
"""

from __future__ import annotations

import torch

from specdec.plugin_api import (
    TREE_KIND,
    DraftProposal,
    LastStateDrafter,
    drafter_directory,
    hookimpl,
    pick_draft_token,
    prefix_trie,
)

from .checkpoint import SHIPPED_DRAFTER, load_drafter
from .model import top_k_scores


class ReDrafterDrafter(LastStateDrafter):
    state_key = "redrafter"

    def __init__(self, config, target):
        super().__init__(config, target)
        directory = drafter_directory(config.speculative_model, target, SHIPPED_DRAFTER, "redrafter", "a drafter")
        self.model = load_drafter(directory, target).to(target.device, target.dtype).eval().requires_grad_(False)
        self.embed = target.parts.embed_tokens
        self.width = config.beam_width
        if self.model.shape.shares_lm_head:  # over the tokens it was trained to draft
            self.share_target_head(directory)

    def _logits(self, context: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        out = self.model.head(context, state)
        return self.target_head_logits(out) if self.model.shape.shares_lm_head else out

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens, max_nodes):
        proposals: list[DraftProposal | None] = [None] * len(requests)
        active = self.ready(requests, draft_lens)
        for group, make in (([i for i in active if not requests[i].sampling_params.draws_drafts], self._beam_proposals),
                            ([i for i in active if requests[i].sampling_params.draws_drafts], self._sampled_proposals)):
            if group:
                context = self.take_states(requests, group)
                roots = torch.tensor([requests[i].token_ids[-1] for i in group], device=context.device)
                for i, proposal in zip(group, make([requests[i] for i in group], context, roots,
                                                   [draft_lens[i] for i in group], [max_nodes[i] for i in group])):
                    proposals[i] = proposal
        return proposals

    @torch.no_grad()
    def beam_search(self, context: torch.Tensor, roots: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``beam_width`` beams of ``depth`` draft tokens (target ids) per row, best first,
        and their cumulative log-probabilities ``[rows, width]`` (``-inf``: no such beam)."""
        rows, width, hidden = context.shape[0], self.width, context.shape[-1]
        context = context[:, None, :].expand(rows, width, hidden)
        tokens = roots[:, None].expand(rows, width)
        state = context.new_zeros(rows, width, hidden)
        # every beam starts from the root: only the first one may grow at the first step
        score = torch.full((rows, width), float("-inf"), device=context.device)
        score[:, 0] = 0.0
        beams = roots.new_empty(rows, width, 0)
        for _ in range(depth):
            state = self.model.next_state(self.embed(tokens), state)
            logp, ids = top_k_scores(self._logits(context, state))  # [rows, width, k]
            k = logp.shape[-1]
            score, flat = (score[..., None] + logp).reshape(rows, width * k).topk(width, dim=-1)
            parent = flat // k
            tokens = self.to_target_ids(ids.reshape(rows, width * k).gather(1, flat))
            beams = torch.cat([beams.gather(1, parent[..., None].expand(-1, -1, beams.shape[-1])), tokens[..., None]],
                              dim=-1)
            state = state.gather(1, parent[..., None].expand(-1, -1, hidden))
        return beams, score

    def _beam_proposals(self, requests, context, roots, depths, budgets):
        beams, score = self.beam_search(context, roots, max(depths))
        live = torch.isfinite(score).tolist()
        out = []
        for row, (depth, budget) in enumerate(zip(depths, budgets)):
            candidates = [b for b, ok in zip(beams[row, :, :depth].tolist(), live[row]) if ok]
            tokens, parents = prefix_trie(candidates, depth)
            # trie nodes come parents first, best beam first: a prefix of them is a tree, and
            # its path of first children is the best beam, what a chain of its depth drafts
            proposal = DraftProposal(token_ids=tokens[:budget], parents=parents[:budget])
            proposal.kind = None if proposal.is_chain else TREE_KIND
            out.append(proposal)
        return out

    @torch.no_grad()
    def _sampled_proposals(self, requests, context, roots, depths, budgets):
        depth, width, hidden = max(depths), self.width, context.shape[-1]
        rows = context.shape[0]
        context = context[:, None, :].expand(rows, width, hidden)
        tokens = roots[:, None].expand(rows, width)
        state = context.new_zeros(rows, width, hidden)
        drawn: list[list[list[tuple[int, torch.Tensor]]]] = [[[] for _ in range(width)] for _ in range(rows)]
        for _ in range(depth):
            state = self.model.next_state(self.embed(tokens), state)
            logits = self._logits(context, state).float()
            picks = [[pick_draft_token(logits[r, b], req.sampling_params, req.generator, self.target.vocab_size,
                                       self.draft_to_target) for b in range(width)] for r, req in enumerate(requests)]
            for r in range(rows):
                for b in range(width):
                    drawn[r][b].append(picks[r][b])
            tokens = torch.tensor([[t for t, _ in row] for row in picks], device=roots.device)
        out = []
        for row, (depth_r, budget) in enumerate(zip(depths, budgets)):
            chains = max(1, min(width, budget // depth_r))
            length = min(depth_r, budget)
            ids, parents, probs = [], [], []
            for b in range(chains):
                for d, (token, q) in enumerate(drawn[row][b][:length]):
                    parents.append(-1 if d == 0 else len(ids) - 1)
                    ids.append(token)
                    probs.append(q)
            out.append(DraftProposal(token_ids=ids, parents=parents, draft_probs=torch.stack(probs),
                                     sibling_sampling="iid", kind=TREE_KIND if chains > 1 else None))
        return out
