"""`specdec train mtp`: one MTP module learns the frozen target's own continuations.

Teacher forcing on the target's tokens and final normalised hidden states (the run's
feature store), with the core's training-time test
(:func:`specdec.training.training_time_test`): ``ttt_steps`` steps of the module unrolled
over every position, each reading the ``h'`` of the step before as at inference (the
module reused autoregressively), loss weights ``step_decay ** j``. The loss is the
cross-entropy against the target's next-token distribution over the ``loss_vocab_size``
most frequent answer tokens (the drafting vocabulary the module is saved with), plus the
smooth L1 distance of ``h'`` to the target's next feature (``feature_weight``).

The block starts as a copy of the target's last decoder layer, ``shared_head.norm`` as its
final norm; ``enorm``/``hnorm`` at one, ``eh_proj`` random. The head is the target's.
"""

from __future__ import annotations

import torch

from specdec.plugin_api import (
    UNROLLED_ATTENTION,
    MethodTrainer,
    TrainBatch,
    draft_vocabulary,
    drafter_directory,
    save_draft_vocab,
    target_signature,
    training_time_test,
)

from .checkpoint import SHIPPED_MODULE, load_module, save_module
from .model import build_module


class MTPTrainer(MethodTrainer):
    name = "mtp"
    options = {"ttt_steps": 3, "step_decay": 0.8, "loss_vocab_size": 8192, "feature_weight": 0.5}

    def __init__(self, target, samples, options):
        super().__init__(target, samples, options)
        self.parts = parts = target.parts
        self.vocab = draft_vocabulary(target, samples, int(self.opts["loss_vocab_size"]))
        mtp = build_module(parts, UNROLLED_ATTENTION)
        with torch.no_grad():
            mtp.block.load_state_dict(parts.decoder_layers[-1].state_dict())
            for norm in (mtp.enorm, mtp.hnorm):
                for p in norm.parameters():
                    p.fill_(1.0)
        self.mtp = mtp.to(device=target.device, dtype=torch.float32).requires_grad_(True)  # norms copied frozen

    def feature_layers(self):
        return [-1]

    def start_from(self, source):
        load_module(drafter_directory(source, self.target, SHIPPED_MODULE, self.name, "an MTP module"), self.target,
                    self.mtp)

    def module(self):
        return self.mtp

    def _step(self, emb, feature, positions, attend):
        rope = self.parts.rope(emb, positions[None])
        return self.mtp(emb, feature, rope, positions[None], unrolled=attend)

    def loss(self, batch: TrainBatch):
        with torch.no_grad():
            emb = self.parts.embed_tokens(batch.input_ids).float()
            teacher_w = self.parts.lm_head.weight[self.vocab].float()
        return training_time_test(self._step, emb, batch.features[-1], batch, int(self.opts["ttt_steps"]),
                                  float(self.opts["step_decay"]), lambda h: h @ teacher_w.T, teacher_w,
                                  float(self.opts["feature_weight"]))

    def save(self, directory):
        meta = {"method": self.name, "target": target_signature(self.target),
                "trained_by": f"specdec train {self.name}", "trainer_options": self.opts}
        save_module(self.mtp, directory, self.target, meta)
        if len(self.vocab) != self.parts.vocab_size:
            save_draft_vocab(directory, self.vocab.cpu())

    def speculative_config(self, directory):
        return {"decoding_type": self.name, "speculative_model": str(directory)}
