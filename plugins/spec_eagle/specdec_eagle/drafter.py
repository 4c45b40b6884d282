"""EAGLE drafting: the head's rows in the core's feature drafter (see
:mod:`specdec.drafting.feature_drafter`), expanded as a chain, a static tree (``eagle_choices``) or an
EAGLE-2 dynamic tree."""

from __future__ import annotations

from specdec.plugin_api import FeatureDrafter, FieldError, draft_attention, drafter_directory, restricted_head

from .checkpoint import SHIPPED_HEADS, load_head


class EagleDrafter(FeatureDrafter):
    generation = 1
    state_key = "eagle"

    def __init__(self, config, target):
        super().__init__(config, target)
        capture = getattr(config, "eagle3_layers_to_capture", None)
        for layer in capture or []:
            if not 0 <= layer < target.num_layers:
                raise FieldError("speculative_config.eagle3_layers_to_capture",
                                 f"layer {layer} is not among the target's layers 0..{target.num_layers - 1}")
        name = "eagle" if self.generation == 1 else "eagle3"
        directory = drafter_directory(config.speculative_model, target, SHIPPED_HEADS[self.generation], name,
                                      "a head")
        head, self.layers = load_head(directory, self.generation, target, capture)
        parts = target.parts
        if self.generation == 1:
            head.lm_head, head.draft_to_target = restricted_head(parts.lm_head, directory, target.vocab_size)
        self.head = head.to_serving(target.device, target.dtype).eval()
        if head.embed_tokens is None:  # the target's, shared: never cast with the head's own modules
            head.embed_tokens = parts.embed_tokens
        self.draft_to_target = head.draft_to_target
        self._scale = head.layer.self_attn.head_dim ** -0.5
        self.start_runner(head.config.hidden_size, config.draft_kv_cache_blocks)

    def draft_forward(self, input_ids, positions, meta, feature):
        emb = self.head.embed_tokens(input_ids)
        return self.head.step(emb, feature, positions,
                              lambda module, q, k, v: draft_attention(module, q, k, v, meta, self._scale))

    def head_logits(self, hidden):
        return self.head.logits(hidden)

    def fuse(self, target_hidden):
        return self.head.fuse(target_hidden)


class Eagle3Drafter(EagleDrafter):
    generation = 3
