"""ReDrafter (``redrafter``, alias ``ReDrafter``): a recurrent draft head on the target's last
hidden state; its beam search proposes a tree, verified in one target forward.

Options (defaults in brackets):
    speculative_model [the shipped drafter on the embedded model]: a directory in the
        reference's layout (``config.json`` with ``model_type: recurrent_drafting_drafter``,
        ``model.safetensors`` or ``pytorch_model.bin``), or what ``specdec train
        redrafter`` wrote. Alias: speculative_model_dir.
    beam_width [4]: beams searched per request and step (1: a chain).
    beam_length [max_draft_len + 1]: tokens per beam as the reference counts them, the
        target's own token included; give it or ``max_draft_len`` (the drafts per beam).
    max_draft_len [4]: the beams' draft tokens: the tree's depth.
    max_total_draft_tokens [beam_width x max_draft_len]: the most tree nodes per step;
        beams sharing a prefix share its nodes, and a tree over the budget keeps its
        best beams. The adaptive planner may ask for the best beam alone (a chain) where
        it pays more than the tree.

Verification is lossless: greedy output equals the target's greedy output, and sampled
output follows the target's distribution.
"""

from __future__ import annotations

import attrs

from specdec.plugin_api import DecodingType, FieldError, SpeculativeConfig, hookimpl, in_range

from .checkpoint import SHIPPED_DRAFTER, load_drafter, save_drafter
from .drafter import ReDrafterDrafter
from .model import DrafterShape, RecurrentDrafter
from .trainer import ReDrafterTrainer


def _depth_from_beam_length(config) -> int:
    return config.beam_length - 1 if config.beam_length is not None else 4


@attrs.frozen(kw_only=True)
class ReDrafterConfig(SpeculativeConfig):
    speculative_model: str | None = None
    beam_width: int = attrs.field(default=4, validator=in_range(1, 64))
    beam_length: int | None = attrs.field(default=None, validator=in_range(2, 65))
    max_draft_len: int = attrs.field(default=attrs.Factory(_depth_from_beam_length, takes_self=True),
                                     validator=in_range(1, 64))

    def __attrs_post_init__(self):
        if self.beam_length is not None and self.beam_length != self.max_draft_len + 1:
            raise FieldError("beam_length", f"{self.beam_length} tokens per beam means max_draft_len "
                                            f"{self.beam_length - 1}, but max_draft_len is {self.max_draft_len}; "
                                            "give one of them")

    def node_budget(self) -> int:
        return self.max_total_draft_tokens or self.beam_width * self.max_draft_len

    @property
    def chain_or_tree(self) -> bool:
        """The planner may ask for the best beam alone in place of the beams' tree: on a
        CPU every verified row past the first costs about a tenth of a step, and a tree of
        four beams costs four rows a level."""
        return self.beam_width > 1


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="redrafter", aliases=("ReDrafter",), config_class=ReDrafterConfig,
                          drafter_class=ReDrafterDrafter, trainer_class=ReDrafterTrainer,
                          description="recurrent draft head on the target's last hidden state; beam search "
                                      "merged into a tree"))


__all__ = ["SHIPPED_DRAFTER", "DrafterShape", "ReDrafterConfig", "ReDrafterDrafter", "ReDrafterTrainer",
           "RecurrentDrafter", "load_drafter", "save_drafter"]
