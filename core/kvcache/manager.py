"""Per-sequence block tables over the block pool: allocate, commit, roll back, share prefixes."""

from __future__ import annotations

import torch

from ..errors import KVCacheFullError
from .block_pool import BlockPool, NoFreeBlocks
from .layout import slot_ids
from .paged_cache import PagedKVCache


class KVCacheManager:
    """Owns the block pool and the KV tensors; sequences hold block tables (lists of blocks).

    A sequence object needs ``token_ids``, ``num_computed`` (tokens whose KV is committed),
    ``block_table`` and ``window_from``: where the cache has sliding-window layers
    (:attr:`PagedKVCache.window_blocks`), the blocks of ``block_table`` from ``window_from``
    on are the ones the sequence holds there; each new block gets a window block, and a
    commit releases those that left the sequence's window.
    """

    def __init__(self, cache: PagedKVCache, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.cache = cache
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self.windows = cache.window_blocks
        #: prompt tokens looked up in the prefix cache, and those found there (its hit rate)
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_fits(self, num_tokens: int) -> None:
        if self.blocks_for(num_tokens) > self.pool.num_blocks:
            raise KVCacheFullError(
                f"the request needs {num_tokens} tokens of KV cache but the whole pool holds "
                f"{self.pool.num_blocks * self.block_size}; raise engine.kv_cache_blocks or "
                "engine.kv_cache_memory_mb, or shorten the prompt / max_tokens")

    def attach_prefix(self, seq) -> int:
        """Give a new sequence the cached blocks of its longest known prefix; returns tokens reused.

        At least the last token is always left to compute, so the step that follows has
        logits to sample from.
        """
        blocks = self.pool.match_prefix(seq.token_ids, len(seq.token_ids) - 1)
        if self.windows is not None:
            blocks = self._window_complete(blocks)
            seq.window_from = self.windows.released_before(len(blocks) * self.block_size)
        seq.block_table = blocks
        seq.num_computed = len(blocks) * self.block_size
        self.prefix_queried_tokens += len(seq.token_ids)
        self.prefix_hit_tokens += seq.num_computed
        return seq.num_computed

    def _window_complete(self, blocks: list[int]) -> list[int]:
        """The longest head of a matched prefix whose last window the sliding layers still
        hold, its window blocks held; the rest of the match is released, to be computed
        again."""
        n, windows = len(blocks), self.windows
        while n:
            gone = [i for i in range(windows.released_before(n * self.block_size), n)
                    if not windows.is_live(blocks[i])]
            if not gone:
                break
            n = gone[-1]
        self.pool.free(blocks[n:])
        del blocks[n:]
        first = windows.released_before(n * self.block_size)
        for block in blocks[first:]:
            windows.hold(block)
        return blocks

    def reserve(self, seq, num_new_tokens: int) -> None:
        """Make room for ``num_new_tokens`` slots after ``seq.num_computed``; NoFreeBlocks if not."""
        need = self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        if need > 0:
            if self.windows is not None and need > self.windows.num_free:
                raise NoFreeBlocks(f"need {need} sliding-window blocks, {self.windows.num_free} free")
            new = self.pool.allocate(need)
            if self.windows is not None:
                self.windows.allocate(new)
            seq.block_table.extend(new)

    def can_reserve(self, seq, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed + num_new_tokens) - len(seq.block_table)
        return need <= self.pool.num_free and (self.windows is None or need <= self.windows.num_free)

    def slots(self, seq, start: int, count: int) -> list[int]:
        return slot_ids(seq.block_table, self.block_size, start, count)

    def commit(self, seq, num_computed: int) -> None:
        """Set the committed length; free blocks past it (rollback) and hash newly full blocks."""
        old_full = seq.num_computed // self.block_size
        seq.num_computed = num_computed
        keep = self.blocks_for(num_computed)
        if keep < len(seq.block_table):
            if self.windows is not None:
                self.windows.release(seq.block_table[max(keep, seq.window_from):])
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]
        if self.windows is not None:
            passed = self.windows.released_before(num_computed)
            if passed > seq.window_from:
                self.windows.release(seq.block_table[seq.window_from:passed])
                seq.window_from = passed
        new_full = num_computed // self.block_size
        if new_full > old_full:
            self.pool.cache_full_blocks(seq.block_table, seq.token_ids, old_full, new_full)

    def free(self, seq) -> None:
        if self.windows is not None:
            self.windows.release(seq.block_table[seq.window_from:])
            seq.window_from = 0
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0

    def move(self, src_slots: list[int], dst_slots: list[int], device) -> None:
        pairs = [(s, d) for s, d in zip(src_slots, dst_slots) if s != d]
        if pairs:
            src = torch.tensor([s for s, _ in pairs], device=device)
            dst = torch.tensor([d for _, d in pairs], device=device)
            self.cache.copy_slots(src, dst)


__all__ = ["KVCacheManager", "NoFreeBlocks"]
