"""MTP drafting: the module's rows in the core's feature drafter (see
:mod:`specdec.drafting.feature_drafter`), a chain of ``max_draft_len`` tokens from one module reused
autoregressively, each step reading the ``h'`` of the step before."""

from __future__ import annotations

from specdec.plugin_api import ATTENTION_NAME, FeatureDrafter, restricted_head

from .checkpoint import load_module, module_directory
from .model import build_module


class MTPDrafter(FeatureDrafter):
    state_key = "mtp"
    layers = [-1]

    def __init__(self, config, target):
        super().__init__(config, target)
        self.directory = module_directory(config.speculative_model, target)
        parts = target.parts
        module = build_module(parts, ATTENTION_NAME)
        load_module(self.directory, target, module)
        self.module = module.to(device=target.device, dtype=target.dtype).eval()
        self.embed = parts.embed_tokens
        self.parts = parts
        head = module.shared_head.head if module.shared_head.head is not None else parts.lm_head
        self.head_projection, self.draft_to_target = restricted_head(head, self.directory, target.vocab_size)
        self.start_runner(target.hidden_size, config.draft_kv_cache_blocks)

    def draft_forward(self, input_ids, positions, meta, feature):
        emb = self.embed(input_ids)[None]
        rope = self.parts.rope(emb, positions[None])
        return self.module(emb, feature[None], rope, positions[None], specdec=meta)[0]

    def head_logits(self, hidden):
        return self.head_projection(hidden)
