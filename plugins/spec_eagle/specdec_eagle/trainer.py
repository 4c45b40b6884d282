"""`specdec train eagle|eagle3`: a head learns the frozen target's own continuations.

Both generations train with the core's *training-time test*
(:func:`specdec.training.training_time_test`): ``ttt_steps`` draft steps unrolled over
every position at once, with loss weights ``step_decay ** j``. The loss is the
cross-entropy against the target's own next-token distribution (soft targets from its
stored final features), restricted to a vocabulary of the answers' most frequent tokens:
EAGLE-3's draft vocabulary (``draft_vocab_size``), and for EAGLE-1, whose head is the
target's, the loss vocabulary (``loss_vocab_size``).
EAGLE-1 also regresses the target's next feature (smooth L1, ``feature_weight``), as its
reference does. The target's features come from the run's feature store, computed once.
"""

from __future__ import annotations

import torch

from specdec.plugin_api import (
    MethodTrainer,
    TrainBatch,
    draft_vocabulary,
    drafter_directory,
    target_signature,
    training_time_test,
)

from .checkpoint import SHIPPED_HEADS, default_capture_layers, head_config, load_head, save_head
from .modules import Eagle1Head, Eagle3Head


class EagleTrainer(MethodTrainer):
    generation = 1
    name = "eagle"
    options = {"ttt_steps": 3, "step_decay": 0.8, "loss_vocab_size": 8192, "feature_weight": 0.5}
    vocab_option = "loss_vocab_size"

    def __init__(self, target, samples, options):
        super().__init__(target, samples, options)
        self.parts = target.parts
        self.vocab = draft_vocabulary(target, samples, int(self.opts[self.vocab_option]))
        self.head = self._build_head().to(target.device)
        self.head.embed_tokens = self.parts.embed_tokens

    def _build_head(self):
        head = Eagle1Head(head_config(self.parts.hf_config))
        head.lm_head = self.parts.lm_head
        self.layers = [-1]
        return head

    def feature_layers(self):
        return sorted(set(self.layers) | {-1})

    def start_from(self, source):
        """The saved head replaces the new one, with its layers and (EAGLE-3) its draft
        vocabulary; EAGLE-1 keeps the loss vocabulary of these samples."""
        directory = drafter_directory(source, self.target, SHIPPED_HEADS[self.generation], self.name, "an EAGLE head")
        head, self.layers = load_head(directory, self.generation, self.target, self.opts.get("layers"))
        head = head.to(device=self.target.device, dtype=torch.float32)
        if self.generation == 1:
            head.lm_head = self.parts.lm_head
        else:
            mapped = head.draft_to_target
            everything = torch.arange(self.parts.vocab_size, device=self.target.device)
            self.vocab = mapped if mapped is not None else everything
        head.embed_tokens = self.parts.embed_tokens
        self.head = head

    def module(self):
        shared = {"embed_tokens", "rotary_emb"} | ({"lm_head"} if self.generation == 1 else set())
        return torch.nn.ModuleDict({k: m for k, m in self.head.named_children() if k not in shared})

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over ``self.vocab``."""
        return hidden @ self.parts.lm_head.weight[self.vocab].T

    def loss(self, batch: TrainBatch):
        with torch.no_grad():
            emb = self.head.embed_tokens(batch.input_ids).float()
            teacher_w = self.parts.lm_head.weight[self.vocab].float()
        feature = self.head.fuse([batch.features[layer] for layer in self.layers])
        feature_weight = float(self.opts["feature_weight"]) if self.generation == 1 else 0.0
        return training_time_test(self.head.step, emb, feature, batch, int(self.opts["ttt_steps"]),
                                  float(self.opts["step_decay"]), self._draft_logits, teacher_w, feature_weight)

    def save(self, directory):
        meta = {"method": self.name, "target": target_signature(self.target),
                "trained_by": f"specdec train {self.name}", "trainer_options": self.opts}
        full = len(self.vocab) == self.parts.vocab_size
        save_head(self.head, directory, meta, self.layers, None if full else self.vocab.cpu())

    def speculative_config(self, directory):
        return {"decoding_type": self.name, "speculative_model": str(directory)}


class Eagle3Trainer(EagleTrainer):
    generation = 3
    name = "eagle3"
    options = {"ttt_steps": 3, "step_decay": 0.8, "draft_vocab_size": 4096, "layers": None}
    vocab_option = "draft_vocab_size"

    def _build_head(self):
        parts = self.parts
        self.layers = list(self.opts["layers"] or default_capture_layers(parts.num_layers))
        bad = [layer for layer in self.layers if not 0 <= layer < parts.num_layers]
        if bad:
            raise ValueError(f"layers {bad} are not among the target's layers 0..{parts.num_layers - 1}")
        head = Eagle3Head(head_config(parts.hf_config), parts.hidden_size, len(self.layers), len(self.vocab),
                          parts.vocab_size)
        with torch.no_grad():
            head.lm_head.weight.copy_(parts.lm_head.weight[self.vocab.cpu()])
            if parts.final_norm is not None:
                head.norm.load_state_dict(parts.final_norm.state_dict())
            if len(self.vocab) != parts.vocab_size:
                head.set_draft_vocab(self.vocab.cpu())
        return head

    def _draft_logits(self, hidden):
        return self.head.logits(hidden)
