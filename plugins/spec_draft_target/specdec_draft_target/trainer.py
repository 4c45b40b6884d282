"""`specdec train draft_target`: distil a small causal LM from the target.

The draft is the target's architecture with ``draft_layers`` layers, initialised from the
target's first layers and final norm; it shares the target's embeddings and LM head
(frozen). It learns the target's own greedy answers (cross-entropy) over a reduced draft
vocabulary: the ``draft_vocab_size`` tokens most frequent in those answers, which makes
its LM head a sixth of the target's on the embedded model.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from specdec.plugin_api import (
    SECTION,
    MethodTrainer,
    TrainBatch,
    check_target,
    draft_vocabulary,
    drafter_directory,
    load_state_checked,
    load_tensors,
    read_config,
    target_signature,
)

from .checkpoint import SHIPPED_DRAFT, WEIGHTS, build_draft_model, save_trained_draft, shared_prefixes


class DraftTargetTrainer(MethodTrainer):
    options = {"draft_layers": 2, "draft_vocab_size": 8192}

    def __init__(self, target, samples, options):
        super().__init__(target, samples, options)
        parts = target.parts
        layers = int(self.opts["draft_layers"])
        if not 1 <= layers < parts.num_layers:
            raise ValueError(f"draft_layers must be between 1 and {parts.num_layers - 1}, got {layers}")
        config = copy.deepcopy(parts.hf_config)
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        self.model = build_draft_model(config, parts, torch.float32).to(target.device)
        base = getattr(self.model, self.model.base_model_prefix)
        for mine, theirs in zip(base.layers, parts.decoder_layers):
            mine.load_state_dict(theirs.state_dict())
        base.norm.load_state_dict(parts.final_norm.state_dict())
        self.base = base
        vocab = parts.vocab_size
        drafted = draft_vocabulary(target, samples, int(self.opts["draft_vocab_size"]))
        self.draft_vocab = drafted if len(drafted) < vocab else None
        head = parts.lm_head.weight.detach()
        self.head = head if self.draft_vocab is None else head[self.draft_vocab.to(head.device)]
        self.to_draft = torch.arange(vocab, device=head.device)
        if self.draft_vocab is not None:
            self.to_draft = torch.full((vocab,), -100, device=head.device)
            self.to_draft[self.draft_vocab.to(head.device)] = torch.arange(len(self.draft_vocab), device=head.device)
        self.trainable = torch.nn.ModuleDict({"layers": base.layers, "norm": base.norm})

    def module(self):
        return self.trainable

    def start_from(self, source):
        directory = drafter_directory(source, self.target, SHIPPED_DRAFT, "draft_target", "a draft")
        check_target(directory, read_config(directory).get(SECTION, {}), self.target)
        path = directory / WEIGHTS
        load_state_checked(self.model, load_tensors(path), path, shared=shared_prefixes(self.model))

    def loss(self, batch: TrainBatch):
        hidden = self.base(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                           use_cache=False).last_hidden_state
        picked = hidden[batch.loss_mask]
        labels = self.to_draft[batch.labels[batch.loss_mask]]
        logits = picked @ self.head.T
        loss = F.cross_entropy(logits, labels, ignore_index=-100)
        acc = (logits.argmax(-1) == labels).float().mean()
        return loss, {"acc": float(acc)}

    def save(self, directory):
        meta = {"method": "draft_target", "target": target_signature(self.target),
                "draft_layers": int(self.opts["draft_layers"]), "trained_by": "specdec train draft_target"}
        save_trained_draft(self.model, directory, meta, self.draft_vocab)

    def speculative_config(self, directory):
        return {"decoding_type": "draft_target", "speculative_model": str(directory)}
