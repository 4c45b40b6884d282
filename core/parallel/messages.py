"""What rank 0 sends the workers: one small typed record per operation on the target.

The workers hold a shard of the target and of its KV cache, nothing else; every operation
that touches either is one of these, in the order rank 0 runs it. Tensors travel on the CPU
and go to each rank's device there.
"""

from __future__ import annotations

import attrs
import torch

from ..kvcache.layout import SequenceSlice


@attrs.frozen
class Fingerprint:
    """What must be equal on every rank before they work together: the configuration and the
    installed plugins (a worker started with another model or plugin set is refused)."""

    config: dict
    plugins: tuple[str, ...]
    specdec_version: str


@attrs.frozen
class BuildTarget:
    """Wrap the loaded shard as a target model now (its probing forward runs collectives)."""


@attrs.frozen
class BuildCache:
    """Allocate the KV cache: ``num_blocks`` of ``block_size`` tokens (rank 0 sized it)."""

    num_blocks: int
    block_size: int


@attrs.frozen
class Forward:
    """One packed target forward: the step's tokens, positions and attention layout (each
    sequence's block table, start, positions, tree mask). Workers compute no logits."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    sequences: list[SequenceSlice]
    batch_invariant: bool


def sequence_on(seq: SequenceSlice, device: torch.device) -> SequenceSlice:
    """``seq`` with its tensors on ``device`` (the CPU to travel, each rank's device after)."""
    return attrs.evolve(seq, **{name: value.to(device) for name in ("positions", "tree_mask", "pending_mask",
                                                                     "pending_positions")
                                if (value := getattr(seq, name)) is not None})


@attrs.frozen
class CopySlots:
    """Copy K/V rows ``src[i] -> dst[i]`` in every layer (an accepted tree path compacted)."""

    src: torch.Tensor
    dst: torch.Tensor


@attrs.frozen
class SetLinearForwards:
    """Choose the linear layers' forwards as rank 0 did (:meth:`TargetModel.set_linear_forwards`)."""

    batch_invariant: bool
    prepack: bool


@attrs.frozen
class Shutdown:
    """Leave the loop and exit."""
