"""Copy K/V rows between slots of one layer's pool (tree-path compaction), torch reference."""

from __future__ import annotations

import torch


def copy_kv_slots_torch(keys: torch.Tensor, values: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """``keys[dst[i]] = keys[src[i]]`` (and values); all reads happen before the writes."""
    keys[dst] = keys[src]
    values[dst] = values[src]
