"""Fixed-size KV blocks: allocation, reference counts, and prefix reuse by content hash.

Only *full* blocks of committed tokens are hashed, so a shared block is never written
again: the partially filled block at a sequence's end is always private. A block whose
last user frees it keeps its hash and contents until it is handed out again (least
recently freed first), so a later request with the same prefix can still reuse it.
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocks(Exception):
    """The pool cannot hand out the blocks asked for right now."""


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """Hash of a full block given its tokens and the hash of the block before it."""
    return hash((parent, tokens))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, tuple[int, tuple[int, ...]]] = {}  # block -> (hash, tokens)
        self.block_of: dict[int, int] = {}  # hash -> block

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free_blocks):
            raise NoFreeBlocks(f"need {n} KV blocks, {len(self.free_blocks)} free")
        out = []
        for _ in range(n):
            block, _ = self.free_blocks.popitem(last=False)
            self._forget_hash(block)
            self.ref_count[block] = 1
            out.append(block)
        return out

    def free(self, blocks: list[int]) -> None:
        # Freed in reverse so a sequence's tail blocks are reused before its shareable head.
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None

    def _forget_hash(self, block: int) -> None:
        entry = self.hash_of.pop(block, None)
        if entry is not None and self.block_of.get(entry[0]) == block:
            del self.block_of[entry[0]]

    def match_prefix(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Blocks already holding the longest run of full blocks of ``token_ids[:max_tokens]``.

        The blocks returned are referenced (taken out of the free list if needed).
        """
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        matched: list[int] = []
        parent = None
        for start in range(0, max_tokens - bs + 1, bs):
            tokens = tuple(token_ids[start:start + bs])
            h = block_hash(parent, tokens)
            block = self.block_of.get(h)
            if block is None or self.hash_of[block][1] != tokens:
                break
            matched.append(block)
            parent = h
        for block in matched:
            if self.ref_count[block] == 0:
                del self.free_blocks[block]
            self.ref_count[block] += 1
        return matched

    def cache_full_blocks(self, blocks: list[int], token_ids: list[int], first: int, last: int) -> None:
        """Record the hashes of ``blocks[first:last]``, full of ``token_ids``' committed tokens."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = self.hash_of[blocks[first - 1]][0] if first > 0 and blocks[first - 1] in self.hash_of else None
        if first > 0 and parent is None:
            return  # an earlier block was never hashed: its chain cannot be named
        for i in range(first, last):
            block = blocks[i]
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, tokens)
            if block not in self.hash_of:
                self.hash_of[block] = (h, tokens)
                self.block_of.setdefault(h, block)
            parent = h
