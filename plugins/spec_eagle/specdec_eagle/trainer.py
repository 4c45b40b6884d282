"""`specdec train eagle|eagle3`: a head learns the frozen target's own continuations.

Both generations train with *training-time test*: ``ttt_steps`` draft steps are unrolled
over every position at once, step ``j`` reading the features step ``j - 1`` produced
(step 0 reads the target's) and attending as the same step does at inference
(:func:`~specdec_eagle.modules.unrolled_attention`), with loss weights
``step_decay ** j``. The loss is the cross-entropy against the target's own next-token
distribution (soft targets from its stored final features), restricted to a vocabulary of
the answers' most frequent tokens: EAGLE-3's draft vocabulary (``draft_vocab_size``),
and for EAGLE-1, whose head is the target's, the loss vocabulary (``loss_vocab_size``).
EAGLE-1 also regresses the target's next feature (smooth L1, ``feature_weight``), as its
reference does. The target's features come from the run's feature store, computed once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.draft_checkpoint import target_signature
from specdec.training import MethodTrainer, TrainBatch, draft_vocabulary

from .checkpoint import default_capture_layers, head_config, save_head
from .modules import Eagle1Head, Eagle3Head, unrolled_attention


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """``out[:, i] = x[:, i + k]``, zero (False) past the end."""
    out = torch.zeros_like(x)
    if k < x.shape[1]:
        out[:, :x.shape[1] - k] = x[:, k:]
    return out


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

    def module(self):
        shared = {"embed_tokens", "rotary_emb"} | ({"lm_head"} if self.generation == 1 else set())
        return torch.nn.ModuleDict({k: m for k, m in self.head.named_children() if k not in shared})

    def _draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over ``self.vocab``."""
        return hidden @ self.parts.lm_head.weight[self.vocab].T

    def loss(self, batch: TrainBatch):
        feats = batch.features
        valid = batch.attention_mask.bool()
        length = valid.shape[1]
        with torch.no_grad():
            emb = self.head.embed_tokens(batch.input_ids).float()
            teacher_w = self.parts.lm_head.weight[self.vocab].float()
        feature = self.head.fuse([feats[layer] for layer in self.layers])
        attend, next_step = unrolled_attention(valid)
        positions = torch.arange(length, device=valid.device)
        decay = float(self.opts["step_decay"])
        total, metrics = 0.0, {}
        for j in range(int(self.opts["ttt_steps"])):
            hidden = self.head.step(_shift(emb, j + 1), feature, positions + j, attend)
            next_step()
            # Row i of step j predicts the token at i + j + 2: the target's distribution at i + j + 1.
            mask = _shift(batch.loss_mask, j + 1)
            if not mask.any():
                break
            goal = _shift(feats[-1], j + 1)[mask]
            with torch.no_grad():
                teacher = torch.softmax(goal @ teacher_w.T, dim=-1)
            draft = self._draft_logits(hidden[mask]).float()
            step_loss = -(teacher * torch.log_softmax(draft, dim=-1)).sum(-1).mean()
            if self.generation == 1:
                step_loss = step_loss + float(self.opts["feature_weight"]) * F.smooth_l1_loss(hidden[mask], goal)
            total = total + decay ** j * step_loss
            metrics[f"acc{j}"] = float((draft.argmax(-1) == teacher.argmax(-1)).float().mean())
            feature = hidden
        return total, metrics

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
