"""EAGLE-1/2 (``eagle``) and EAGLE-3 (``eagle3``): a one-layer draft head over the target's
features, drafting chains, static trees or EAGLE-2 dynamic trees.

Options (defaults in brackets; TensorRT-LLM's names):
    speculative_model [the shipped head on the embedded model]: a head directory in the
        published EAGLE-1 or EAGLE-3 layout, or one ``specdec train eagle|eagle3`` wrote.
        Alias: speculative_model_dir.
    max_draft_len [3]: draft depth (one draft forward per level for the whole batch).
    eagle_choices [none]: a static tree in TensorRT-LLM's notation (every node, or the
        unique paths), ranks among each parent's best tokens; its depth must fit
        max_draft_len, and max_total_draft_tokens defaults to its node count.
    use_dynamic_tree [false], dynamic_tree_max_topK [4]: EAGLE-2: each level expands the
        topK best frontier nodes into their topK best children; after max_draft_len
        levels the max_total_draft_tokens [16] best nodes by cumulative log-probability
        are verified; with ``adaptive`` on, each step and request gets the tree or the
        chain, whichever pays more by live estimates.
    eagle3_layers_to_capture [the checkpoint's, else 1, N/2-1, N-4]: target layers
        whose hidden states EAGLE-3 reads.
    draft_kv_cache_blocks [1024]: the head's KV pool, in blocks of 16 tokens.

Verification is lossless: greedy output equals the target's greedy output; sampled
chains are drawn from the draft distribution (rejection sampling), trees take the top-k
tokens deterministically (recursive rejection sampling with one-hot proposals).
"""

from __future__ import annotations

import attrs

from specdec.plugin_api import DecodingType, FieldError, StaticTree, TreeDraftConfig, hookimpl, in_range

from .checkpoint import SHIPPED_HEADS, load_head, save_head
from .drafter import Eagle3Drafter, EagleDrafter
from .trainer import Eagle3Trainer, EagleTrainer


@attrs.frozen(kw_only=True)
class EagleConfig(TreeDraftConfig):
    max_draft_len: int = attrs.field(default=3, validator=in_range(1, 64))
    speculative_model: str | None = None
    eagle_choices: list[list[int]] | None = attrs.field(default=None)
    draft_kv_cache_blocks: int = attrs.field(default=1024, validator=in_range(1, None))

    @eagle_choices.validator
    def _check_choices(self, attribute, value):
        if value is None:
            return
        if self.use_dynamic_tree:
            raise FieldError(attribute.name, "a static tree and use_dynamic_tree exclude each other; give one")
        StaticTree.from_config(value, self.max_draft_len, attribute.name)

    def static_tree_choices(self):
        return self.eagle_choices


@attrs.frozen(kw_only=True)
class Eagle3Config(EagleConfig):
    eagle3_layers_to_capture: list[int] | None = None


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="eagle", aliases=("Eagle",), config_class=EagleConfig, drafter_class=EagleDrafter,
                          trainer_class=EagleTrainer,
                          description="EAGLE-1/2 draft head over the target's last feature; chains, static or "
                                      "dynamic trees"))
    register(DecodingType(name="eagle3", aliases=("Eagle3",), config_class=Eagle3Config,
                          drafter_class=Eagle3Drafter, trainer_class=Eagle3Trainer,
                          description="EAGLE-3 draft head over a low, a middle and a high target layer, reduced "
                                      "draft vocabulary; chains, static or dynamic trees"))


__all__ = ["SHIPPED_HEADS", "Eagle3Config", "Eagle3Drafter", "Eagle3Trainer", "EagleConfig", "EagleDrafter",
           "EagleTrainer", "load_head", "save_head"]
