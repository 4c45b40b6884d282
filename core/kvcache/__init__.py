"""Paged KV cache: block pool with prefix reuse, per-sequence block tables, KV tensors, and the
target hidden states kept beside them for drafters that read every prompt token."""

from .block_pool import BlockPool, NoFreeBlocks
from .hidden_cache import HiddenStateCache
from .manager import KVCacheManager
from .paged_cache import PagedKVCache

__all__ = ["BlockPool", "HiddenStateCache", "KVCacheManager", "NoFreeBlocks", "PagedKVCache"]
