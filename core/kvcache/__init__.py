"""Paged KV cache: block pool with prefix reuse, per-sequence block tables, KV tensors."""

from .block_pool import BlockPool, NoFreeBlocks
from .manager import KVCacheManager
from .paged_cache import PagedKVCache

__all__ = ["BlockPool", "KVCacheManager", "NoFreeBlocks", "PagedKVCache"]
