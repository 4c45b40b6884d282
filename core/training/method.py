"""What a drafting method contributes to ``specdec train``, and what the core hands it.

A plugin registers ``DecodingType(..., trainer_class=MyTrainer)``; ``MyTrainer`` subclasses
:class:`MethodTrainer` and supplies the trainable module, the loss and the save format.
The core owns everything else (data, batches, optimizer, schedule, checkpoints, resume,
progress, evaluation): see :mod:`specdec.training.loop`.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import attrs
import torch

from ..model.target import TargetParts, target_parts
from .data import Sample


class TrainTarget:
    """The frozen target as training sees it: a plain transformers model (no paged cache).

    Attributes: ``model``, ``parts`` (:class:`~specdec.model.target.TargetParts`),
    ``tokenizer``, ``name``, ``hidden_size``, ``num_layers``, ``vocab_size``, ``device``,
    ``dtype``, ``path`` (the HF directory the weights came from).
    """

    def __init__(self, model, tokenizer, name: str, path: Path):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.name = name
        self.path = path
        self.parts: TargetParts = target_parts(model)
        self.hidden_size = self.parts.hidden_size
        self.num_layers = self.parts.num_layers
        self.vocab_size = self.parts.vocab_size
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
            layers: list[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Teacher forward: logits ``[B, L, V]`` and the hidden states of ``layers`` (``i``: the
        output of decoder layer ``i``; ``-1``: the final normalised state)."""
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=bool(layers),
                         use_cache=False)
        hidden = {}
        for layer in layers:
            # hidden_states[0] is the embedding output; [i + 1] is layer i's output, and the
            # last entry is already normalised by the final norm.
            hidden[layer] = out.hidden_states[-1] if layer == -1 else out.hidden_states[layer + 1]
        return out.logits, hidden


@attrs.define
class TrainBatch:
    """A padded batch of samples.

    Attributes:
        input_ids, attention_mask: ``[B, L]``.
        labels: ``[B, L]`` the target's next token after each position (its own greedy
            answer, or its prediction for plain text).
        loss_mask: ``[B, L]`` bool, the positions whose next token is learnt.
        target: the frozen target, for methods that need its logits (:meth:`TrainTarget.run`).
        features: layer -> ``[B, L, hidden]`` float32 target hidden states of the layers
            the method asked for (:meth:`MethodTrainer.feature_layers`), read from the
            run's feature store; zero past each sample's end.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    target: TrainTarget
    features: dict[int, torch.Tensor] = attrs.Factory(dict)

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())


class MethodTrainer:
    """Base class of a method's trainer. Subclasses set ``options`` and implement the methods.

    ``MethodTrainer(target, samples, options)``: ``samples`` are the training samples (a
    method may read statistics from them, such as a draft vocabulary); ``options`` the
    ``--set`` options given on the command line, checked against ``options``.
    """

    #: option name -> default; ``specdec train --set name=value`` changes them.
    options: ClassVar[dict[str, object]] = {}

    def __init__(self, target: TrainTarget, samples: list[Sample], options: dict):
        self.target = target
        self.opts = self.check_options(options)

    @classmethod
    def check_options(cls, options: dict) -> dict:
        """The options with defaults filled in; a ValueError names unknown ones."""
        unknown = sorted(set(options) - set(cls.options))
        if unknown:
            raise ValueError(f"unknown trainer option(s) {unknown}; this method takes {sorted(cls.options)}")
        return {**cls.options, **options}

    def feature_layers(self) -> list[int]:
        """Target layers whose hidden states the loss reads (``i``: output of decoder layer
        ``i``; ``-1``: the final normalised state). The loop computes them once, stores them
        with the run (:mod:`specdec.training.features`) and hands them in
        :attr:`TrainBatch.features`. Default: none."""
        return []

    def module(self) -> torch.nn.Module:
        """The module whose trainable parameters the optimizer updates and checkpoints save."""
        raise NotImplementedError

    def start_from(self, source: str | None) -> None:
        """Load a drafter this method saved into :meth:`module` before training
        (``specdec train --init``): fine-tuning, for example the drafter shipped for the
        embedded model on a user's own prompts. ``source``: its directory, or None for the
        drafter the method loads by default on this target. Checked against the target as
        at inference. A trainer that does not implement it refuses ``--init``."""
        raise NotImplementedError

    def loss(self, batch: TrainBatch) -> tuple[torch.Tensor, dict[str, float]]:
        """The scalar loss of one batch, and metrics to show (``{"acc": ...}``)."""
        raise NotImplementedError

    def save(self, directory: Path) -> None:
        """Write the trained drafter into ``directory`` in the method's load format."""
        raise NotImplementedError

    def speculative_config(self, directory: Path) -> dict:
        """The ``speculative_config`` that loads what :meth:`save` wrote (used for evaluation)."""
        raise NotImplementedError
