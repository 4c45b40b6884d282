"""How many KV blocks an engine gets: ``engine.kv_cache_blocks`` if given, else what fits
in ``kv_cache_memory_fraction`` of the device's free memory (or ``kv_cache_memory_mb``),
counting each token's K/V in every layer and, where kept, its hidden states for drafters.

Sliding-window layers get pools of their own (:class:`specdec.kvcache.window_blocks.WindowBlocks`),
sized to serve every running request at once: each reads its last window and writes its
step's tokens. The rest of the budget goes to the layers that keep every token.
"""

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


def window_blocks_needed(config: EngineConfig, window: int) -> int:
    """Window blocks for ``engine.max_batch_size`` requests, each reading its last
    ``window`` positions and reserving its step's tokens (``engine.max_num_tokens`` in all),
    every one starting mid-block."""
    blocks = lambda tokens: -(-tokens // config.block_size)  # noqa: E731
    return config.max_batch_size * (blocks(window - 1) + 3) + blocks(config.max_num_tokens)


def kv_cache_blocks(config: EngineConfig, target: TargetModel, hidden_layers_kept: int,
                    max_model_len: int) -> tuple[int, int]:
    """Blocks of ``config.block_size`` tokens for ``target``'s KV (and the hidden states of
    ``hidden_layers_kept`` layers per token), and blocks for its sliding-window layers (0:
    they keep every token too). Windows are kept apart only where they save memory: a
    window shorter than ``max_model_len``, one process (a sharded target's workers keep
    whole layers) and no CUDA graphs (whose tables address one pool)."""
    windows = [w for w in target.layer_windows if w is not None]
    window = max(windows, default=None)
    apart = (window is not None and window < max_model_len and target.tensor_parallel_size == 1
             and not config.cuda_graphs)
    hidden = (HiddenStateCache.bytes_per_token(hidden_layers_kept, target.hidden_size, target.dtype)
              if hidden_layers_kept else 0)
    whole = PagedKVCache.bytes_per_token(target.layer_shapes, target.dtype) + hidden
    budget = (free_memory_bytes(target.device) * config.kv_cache_memory_fraction
              if config.kv_cache_memory_fraction else config.kv_cache_memory_mb * 2**20)
    num_blocks = config.kv_cache_blocks or max(1, int(budget // (config.block_size * whole)))
    window_blocks = window_blocks_needed(config, window) if apart else 0
    if window_blocks >= num_blocks:
        return num_blocks, 0
    if config.kv_cache_blocks:
        return num_blocks, window_blocks
    windowed = [shape for shape, w in zip(target.layer_shapes, target.layer_windows) if w is not None]
    full = [shape for shape, w in zip(target.layer_shapes, target.layer_windows) if w is None]
    token = PagedKVCache.bytes_per_token(full, target.dtype) + hidden
    left = budget - window_blocks * config.block_size * PagedKVCache.bytes_per_token(windowed, target.dtype)
    # Without a layer that keeps every token, a block of the tables holds nothing: enough of
    # them for every request at its longest.
    tables = config.max_batch_size * -(-max_model_len // config.block_size)
    return (max(num_blocks, int(left // (config.block_size * token))) if token else max(num_blocks, tables),
            window_blocks)
