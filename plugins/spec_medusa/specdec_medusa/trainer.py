"""`specdec train medusa`: heads learn the frozen target's own continuations (Medusa-1).

Head ``k`` reads the target's final normalised hidden state at position ``i`` and learns
the target's own next-token distribution at position ``i + k + 1`` (soft targets from the
stored final states, as the target would predict the token ``k + 2`` ahead), over the
answers' most frequent tokens (``loss_vocab_size``), with loss weight
``head_decay ** k``. The heads share the target's LM head (``shares_lm_head``); their
ResBlocks start as the identity, so an untrained head drafts what the target's own head
predicts for the next position. The drafting vocabulary is saved with them.
"""

from __future__ import annotations

import torch

from specdec.plugin_api import (
    MethodTrainer,
    TrainBatch,
    draft_vocabulary,
    drafter_directory,
    load_state_checked,
    save_draft_vocab,
    target_signature,
)

from .checkpoint import SHIPPED_HEADS, load_heads, save_heads
from .heads import MedusaHeads


class MedusaTrainer(MethodTrainer):
    options = {"num_heads": 3, "num_layers": 1, "head_decay": 0.8, "loss_vocab_size": 8192}

    def __init__(self, target, samples, options):
        super().__init__(target, samples, options)
        self.parts = target.parts
        self.vocab = draft_vocabulary(target, samples, int(self.opts["loss_vocab_size"]))
        self.heads = MedusaHeads(self.parts.hidden_size, int(self.opts["num_heads"]), int(self.opts["num_layers"]),
                                 None).to(target.device)

    def feature_layers(self):
        return [-1]

    def start_from(self, source):
        directory = drafter_directory(source, self.target, SHIPPED_HEADS, "medusa", "Medusa heads")
        load_state_checked(self.heads, load_heads(directory, self.target).state_dict(), directory)

    def module(self):
        return self.heads

    def loss(self, batch: TrainBatch):
        final = batch.features[-1]
        with torch.no_grad():
            weight = self.parts.lm_head.weight[self.vocab].float()
        total, metrics = 0.0, {}
        for k, head in enumerate(self.heads):
            shift = k + 1
            if shift >= final.shape[1]:
                break
            # position i learns the target's distribution at i + k + 1 (the token k + 2 ahead)
            mask = batch.loss_mask[:, shift:]
            if not mask.any():
                break
            with torch.no_grad():
                teacher = torch.softmax(final[:, shift:][mask] @ weight.T, dim=-1)
            draft = head(final[:, :-shift][mask]) @ weight.T
            head_loss = -(teacher * torch.log_softmax(draft, dim=-1)).sum(-1).mean()
            total = total + float(self.opts["head_decay"]) ** k * head_loss
            metrics[f"acc{k}"] = float((draft.argmax(-1) == teacher.argmax(-1)).float().mean())
        return total, metrics

    def save(self, directory):
        meta = {"method": "medusa", "target": target_signature(self.target), "trained_by": "specdec train medusa",
                "trainer_options": self.opts}
        save_heads(self.heads, directory, meta)
        if len(self.vocab) != self.parts.vocab_size:
            save_draft_vocab(directory, self.vocab)

    def speculative_config(self, directory):
        return {"decoding_type": "medusa", "speculative_model": str(directory), "max_draft_len": len(self.heads)}
