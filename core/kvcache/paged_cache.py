"""The KV tensors: one preallocated pool per layer, addressed by slot (block * size + offset)."""

from __future__ import annotations

import torch

from ..kernels import copy_kv_slots


class PagedKVCache:
    """Keys and values of every layer, ``[num_blocks * block_size, kv_heads, head_dim]`` each.

    ``layer_shapes[i] = (kv_heads, key_dim, value_dim)``: read off the model by a probe
    forward, so grouped-query, multi-latent (DeepSeek) and per-layer head sizes all fit.
    One more slot past the blocks, :attr:`scratch_slot`, belongs to no block: a CUDA
    graph's padding tokens write their K/V there (:mod:`specdec.executor.cuda_graphs`).
    """

    def __init__(self, layer_shapes: list[tuple[int, int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.scratch_slot = num_blocks * block_size
        slots = self.scratch_slot + 1
        self.keys = [torch.zeros(slots, h, dk, dtype=dtype, device=device) for h, dk, _ in layer_shapes]
        self.values = [torch.zeros(slots, h, dv, dtype=dtype, device=device) for h, _, dv in layer_shapes]

    @staticmethod
    def bytes_per_token(layer_shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(h * (dk + dv) for h, dk, dv in layer_shapes) * size

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V rows ``src[i] -> dst[i]`` in every layer (compacting an accepted tree path)."""
        for k, v in zip(self.keys, self.values):
            copy_kv_slots(k, v, src, dst)
