"""`specdec train redrafter`: the recurrent drafter learns the frozen target's own
continuations, unrolled as at drafting time.

From each position ``i`` (context: the target's final normalised state there), step ``j``
reads the embedding of the target's token ``i + j`` and learns the target's own
next-token distribution at ``i + j`` (soft targets from the stored final states, over the
answers' most frequent tokens, ``loss_vocab_size``), for ``j = 1 .. depth``, with loss
weight ``depth_decay ** (j - 1)``: the reference's unrolled loss, with the target's
distribution in place of its one-hot labels. The drafter shares the target's LM head
(``exit_dim`` = hidden size, no projection); it starts as "the target's head on the
context" (``input_proj`` = ``[I 0]``, ResBlocks at the identity) and learns from there.
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

from .checkpoint import SHIPPED_DRAFTER, load_drafter, save_drafter
from .model import DrafterShape, RecurrentDrafter


class ReDrafterTrainer(MethodTrainer):
    options = {"num_draft_layers": 2, "rnn": True, "depth": 4, "depth_decay": 0.9, "loss_vocab_size": 8192}

    def __init__(self, target, samples, options):
        super().__init__(target, samples, options)
        self.parts = target.parts
        self.vocab = draft_vocabulary(target, samples, int(self.opts["loss_vocab_size"]))
        hidden = self.parts.hidden_size
        self.drafter = RecurrentDrafter(DrafterShape(hidden_size=hidden, exit_dim=hidden,
                                                     num_draft_layers=int(self.opts["num_draft_layers"]),
                                                     rnn=bool(self.opts["rnn"]))).to(target.device)
        with torch.no_grad():
            self.drafter.input_proj.weight.zero_()
            self.drafter.input_proj.weight[:, :hidden].copy_(torch.eye(hidden))
            self.drafter.input_proj.bias.zero_()
            for block in self.drafter.lm_head:
                block.linear.weight.zero_()

    def feature_layers(self):
        return [-1]

    def start_from(self, source):
        directory = drafter_directory(source, self.target, SHIPPED_DRAFTER, "redrafter", "a recurrent drafter")
        load_state_checked(self.drafter, load_drafter(directory, self.target).state_dict(), directory)

    def module(self):
        return self.drafter

    def loss(self, batch: TrainBatch):
        final = batch.features[-1]
        length = final.shape[1]
        with torch.no_grad():
            weight = self.parts.lm_head.weight[self.vocab].float()
            teacher = torch.softmax(final @ weight.T, dim=-1)
            embeds = self.parts.embed_tokens(batch.labels).float()  # labels[:, i]: the token at i + 1
        state = final.new_zeros(final.shape[0], length, final.shape[2])
        total, metrics = 0.0, {}
        for j in range(1, int(self.opts["depth"]) + 1):
            rows = length - j  # starts i whose step-j target (position i + j) lies in the sample
            if rows <= 0:
                break
            state = self.drafter.next_state(embeds[:, j - 1:j - 1 + rows], state[:, :rows])
            mask = batch.loss_mask[:, j:j + rows]
            if not mask.any():
                break
            draft = self.drafter.head(final[:, :rows][mask], state[mask]) @ weight.T
            want = teacher[:, j:j + rows][mask]
            step_loss = -(want * torch.log_softmax(draft, dim=-1)).sum(-1).mean()
            total = total + float(self.opts["depth_decay"]) ** (j - 1) * step_loss
            metrics[f"acc{j}"] = float((draft.argmax(-1) == want.argmax(-1)).float().mean())
        return total, metrics

    def save(self, directory):
        meta = {"method": "redrafter", "target": target_signature(self.target),
                "trained_by": "specdec train redrafter", "trainer_options": self.opts}
        save_drafter(self.drafter, directory, meta)
        if len(self.vocab) != self.parts.vocab_size:
            save_draft_vocab(directory, self.vocab)

    def speculative_config(self, directory):
        return {"decoding_type": "redrafter", "speculative_model": str(directory),
                "max_draft_len": int(self.opts["depth"])}
