"""Drafters that read the target's last hidden state: Medusa's heads, ReDrafter's RNN.

Both draft from the target's final normalised hidden state of the token whose logits gave
the request's newest token (the heads look past it), kept per request from one
verification to the next draft; and both may read their logits through the target's own
LM head, restricted to the drafting vocabulary they were trained on, instead of carrying
a projection of their own. :class:`LastStateDrafter` holds that shared part.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch

from .checkpoint import restricted_head
from .hookspecs import hookimpl
from .interface import Drafter


class LastStateDrafter(Drafter):
    """Base class: subclasses set ``state_key`` and implement ``prepare_draft_tokens``,
    taking the states with :meth:`take_states`."""

    #: the key of the kept state in ``request.drafter_state``
    state_key: ClassVar[str]
    #: drafting vocabulary -> target token ids (None: the whole target vocabulary)
    draft_to_target: torch.Tensor | None = None

    def share_target_head(self, directory: Path) -> None:
        """Read logits through the target's LM head, over the drafting vocabulary saved in
        ``directory`` (``draft_vocab.safetensors``; all tokens without one)."""
        self.head_projection, self.draft_to_target = restricted_head(self.target.parts.lm_head, directory,
                                                                     self.target.vocab_size)

    def target_head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the drafting vocabulary of states ``[..., hidden]`` (after
        :meth:`share_target_head`)."""
        return self.head_projection(hidden)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Target token ids of drafting-vocabulary indices."""
        return ids if self.draft_to_target is None else self.draft_to_target[ids]

    def ready(self, requests, draft_lens) -> list[int]:
        """Indices of the requests that may draft this step and have a state to draft from."""
        return [i for i, r in enumerate(requests) if self.state_key in r.drafter_state and draft_lens[i] > 0]

    def take_states(self, requests, indices: list[int]) -> torch.Tensor:
        """``[len(indices), hidden]``: the kept states of those requests (each used once)."""
        return torch.stack([requests[i].drafter_state.pop(self.state_key) for i in indices])

    @hookimpl
    def target_hidden_layers(self, target):
        return [-1]

    @hookimpl
    def reads_prompt_hidden_states(self):
        return False  # the newest token's state only: no states kept for cached prefixes

    @hookimpl
    def on_draft_verified(self, results):
        for r in results:
            if r.new_token_ids and -1 in r.hidden_states:
                r.request.drafter_state[self.state_key] = r.hidden_states[-1][-1]
