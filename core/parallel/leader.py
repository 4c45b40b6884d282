"""Rank 0's target and KV cache: every operation on them is sent to the workers first.

A :class:`ShardedTarget` is a :class:`~specdec.model.target.TargetModel` over rank 0's shard;
each forward, each choice of linear forwards and the cache it allocates are announced to the
workers (:mod:`.messages`), which run the same on theirs. The engine above sees a target
like any other.
"""

from __future__ import annotations

import torch

from ..kvcache import PagedKVCache
from ..model.target import ForwardMetadata, TargetModel
from .group import TensorParallelGroup
from .messages import BuildCache, BuildTarget, CopySlots, Forward, SetLinearForwards, sequence_on


class ShardedTarget(TargetModel):
    """Rank 0's shard of a tensor-parallel target (:class:`TargetModel`'s interface)."""

    def __init__(self, model, tokenizer, name: str, group: TensorParallelGroup, max_model_len: int | None = None,
                 path=None):
        self.group = group
        self.tensor_parallel_size = group.size
        group.send(BuildTarget())
        super().__init__(model, tokenizer, name, max_model_len=max_model_len, path=path)

    def check_healthy(self) -> None:
        self.group.check()

    def set_linear_forwards(self, batch_invariant: bool, prepack: bool) -> None:
        self.group.send(SetLinearForwards(batch_invariant, prepack))
        super().set_linear_forwards(batch_invariant, prepack)

    def compile(self) -> None:
        raise NotImplementedError("a tensor-parallel target runs eagerly")

    def new_kv_cache(self, num_blocks: int, block_size: int, num_window_blocks: int = 0) -> PagedKVCache:
        if num_window_blocks:
            raise ValueError("a sharded target keeps its sliding-window layers' whole history: no window blocks")
        self.group.send(BuildCache(num_blocks, block_size))
        return MirroredKVCache(self.group, self.layer_shapes, num_blocks, block_size, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: ForwardMetadata,
                logits_rows: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        cpu = torch.device("cpu")
        self.group.send(Forward(input_ids.to(cpu), positions.to(cpu), [sequence_on(s, cpu) for s in meta.layout.seqs],
                                meta.batch_invariant))
        return super().forward(input_ids, positions, meta, logits_rows)

    def close(self) -> None:
        self.group.close()


class MirroredKVCache(PagedKVCache):
    """Rank 0's KV shard; every copy between slots is made on the workers' shards too."""

    def __init__(self, group: TensorParallelGroup, *args):
        super().__init__(*args)
        self.group = group

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.group.send(CopySlots(src.cpu(), dst.cpu()))
        super().copy_slots(src, dst)

