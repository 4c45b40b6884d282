"""The KV tensors: one preallocated pool per layer, addressed by slot (block * size + offset)."""

from __future__ import annotations

import torch

from ..kernels import copy_kv_slots
from .window_blocks import WindowBlocks
from .zeroed import zeroed


class PagedKVCache:
    """Keys and values of every layer, ``[num_blocks * block_size, kv_heads, head_dim]`` each.

    ``layer_shapes[i] = (kv_heads, key_dim, value_dim)``: read off the model by a probe
    forward, so grouped-query, multi-latent (DeepSeek) and per-layer head sizes all fit.
    One more slot past the blocks, :attr:`scratch_slot`, belongs to no block: a CUDA
    graph's padding tokens write their K/V there (:mod:`specdec.executor.cuda_graphs`).

    ``layer_windows[i]``: layer ``i``'s sliding window (None: it reads every position).
    Given ``num_window_blocks``, the sliding layers' pools hold that many blocks (and
    :attr:`WindowBlocks.trash`) instead, addressed through :attr:`window_blocks`.
    """

    def __init__(self, layer_shapes: list[tuple[int, int, int]], num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, layer_windows: list[int | None] | None = None,
                 num_window_blocks: int = 0):
        self.scratch_slot = num_blocks * block_size
        windows = layer_windows if num_window_blocks else None
        #: per layer, whether its pools are window blocks
        self.windowed = tuple(w is not None for w in windows) if windows else (False,) * len(layer_shapes)
        self.window_blocks = (WindowBlocks(num_window_blocks, num_blocks, block_size,
                                           max(w for w in windows if w is not None)) if any(self.windowed) else None)
        window_slots = (num_window_blocks + 1) * block_size
        sizes = [window_slots if windowed else self.scratch_slot + 1 for windowed in self.windowed]
        self.keys = [zeroed((n, h, dk), dtype, device) for n, (h, dk, _) in zip(sizes, layer_shapes)]
        self.values = [zeroed((n, h, dv), dtype, device) for n, (h, _, dv) in zip(sizes, layer_shapes)]

    @staticmethod
    def bytes_per_token(layer_shapes: list[tuple[int, int, int]], dtype: torch.dtype) -> int:
        size = torch.empty((), dtype=dtype).element_size()
        return sum(h * (dk + dv) for h, dk, dv in layer_shapes) * size

    def layout_for(self, layer: int, layout):
        """The step's layout as ``layer``'s pools are addressed."""
        return self.window_blocks.layout_of(layout) if self.windowed[layer] else layout

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy K/V rows ``src[i] -> dst[i]`` in every layer (compacting an accepted tree path)."""
        if self.window_blocks is not None:
            window_src, window_dst = self.window_blocks.slots(src), self.window_blocks.slots(dst)
        for k, v, windowed in zip(self.keys, self.values, self.windowed):
            if windowed:
                copy_kv_slots(k, v, window_src, window_dst)
            else:
                copy_kv_slots(k, v, src, dst)
