"""Medusa (``medusa``, alias ``Medusa``): heads on the target's last hidden state propose a
static tree, verified in one target forward.

Options (defaults in brackets):
    speculative_model [the shipped heads on the embedded model]: a Medusa-1 directory
        (``config.json`` + ``medusa_lm_head.safetensors`` or ``.pt``), a model directory
        with Medusa-2 heads (``medusa_head.*`` tensors), or what ``specdec train medusa``
        wrote. Alias: speculative_model_dir.
    max_draft_len [3]: tree depth (one head per level).
    num_medusa_heads [all in the checkpoint]: the most heads used.
    medusa_choices [:data:`DEFAULT_CHOICES`]: the static tree in TensorRT-LLM's notation
        (every node, or the unique paths), ranks among each head's best tokens; at most
        max_draft_len deep. max_total_draft_tokens defaults to its node count.
    use_typical_acceptance [false], posterior_threshold [0.09], posterior_alpha [0.3]:
        Medusa's typical acceptance, opt-in and NOT lossless (labelled so in
        ``specdec plugins`` and in each request's metrics).

Verification is otherwise lossless: greedy output equals the target's greedy output,
and sampled output follows the target's distribution.
"""

from __future__ import annotations

import attrs

from specdec.plugin_api import DecodingType, SpeculativeConfig, StaticTree, TypicalAcceptance, hookimpl, in_range

from .checkpoint import SHIPPED_HEADS, load_heads, save_heads
from .drafter import MedusaDrafter
from .heads import MedusaHeads
from .trainer import MedusaTrainer

#: The default tree: the best chain three deep and the runners-up
#: where the shipped heads' acceptance said they pay.
DEFAULT_CHOICES = [[0], [0, 0], [0, 0, 0], [1], [0, 1], [2], [1, 0]]


@attrs.frozen(kw_only=True)
class MedusaConfig(SpeculativeConfig):
    max_draft_len: int = attrs.field(default=3, validator=in_range(1, 64))
    speculative_model: str | None = None
    num_medusa_heads: int | None = attrs.field(default=None, validator=in_range(1, 64))
    medusa_choices: list[list[int]] | None = attrs.field(default=None)
    use_typical_acceptance: bool = False
    posterior_threshold: float = attrs.field(default=0.09, validator=in_range(0.0, 1.0))
    posterior_alpha: float = attrs.field(default=0.3, validator=in_range(0.0, 1.0))

    @medusa_choices.validator
    def _check_choices(self, attribute, value):
        if value is not None:
            StaticTree.from_config(value, self.max_draft_len, attribute.name)

    def static_tree(self) -> StaticTree:
        """The tree to draft: ``medusa_choices``, or the default cut to ``max_draft_len``."""
        if self.medusa_choices:
            return StaticTree.from_choices(self.medusa_choices)
        return StaticTree.from_choices([c for c in DEFAULT_CHOICES if len(c) <= self.max_draft_len])

    def node_budget(self) -> int:
        return self.max_total_draft_tokens or self.static_tree().num_nodes

    @property
    def chain_or_tree(self) -> bool:
        """The planner may ask for the tree's best chain in its place."""
        return True

    def acceptance_rule(self, tokenizer=None):
        """Typical acceptance when switched on: faster, but NOT lossless."""
        return TypicalAcceptance(self.posterior_threshold, self.posterior_alpha) if self.use_typical_acceptance \
            else None


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="medusa", aliases=("Medusa",), config_class=MedusaConfig, drafter_class=MedusaDrafter,
                          trainer_class=MedusaTrainer, lossy_options=("use_typical_acceptance",),
                          description="Medusa heads on the target's last hidden state; a static tree"))


__all__ = ["DEFAULT_CHOICES", "SHIPPED_HEADS", "MedusaConfig", "MedusaDrafter", "MedusaHeads", "MedusaTrainer",
           "load_heads", "save_heads"]
