"""How many KV blocks an engine gets: ``engine.kv_cache_blocks`` if given, else what fits
in ``kv_cache_memory_fraction`` of the device's free memory (or ``kv_cache_memory_mb``),
counting each token's K/V in every layer and, where kept, its hidden states for drafters."""

from __future__ import annotations

import os

import torch

from ..config import EngineConfig
from ..kvcache import HiddenStateCache, PagedKVCache
from ..model.target import TargetModel


def free_memory_bytes(device: torch.device) -> int:
    """Free memory of the device the KV cache lives on (CUDA: the driver's; CPU: the OS's)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_cache_blocks(config: EngineConfig, target: TargetModel, hidden_layers_kept: int) -> int:
    """Blocks of ``config.block_size`` tokens for ``target``'s KV (and the hidden states of
    ``hidden_layers_kept`` layers per token)."""
    if config.kv_cache_blocks:
        return config.kv_cache_blocks
    token_bytes = PagedKVCache.bytes_per_token(target.layer_shapes, target.dtype) + (
        HiddenStateCache.bytes_per_token(hidden_layers_kept, target.hidden_size, target.dtype)
        if hidden_layers_kept else 0)
    budget = (free_memory_bytes(target.device) * config.kv_cache_memory_fraction
              if config.kv_cache_memory_fraction else config.kv_cache_memory_mb * 2**20)
    return max(1, int(budget // (config.block_size * token_bytes)))
