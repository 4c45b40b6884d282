"""Where the sliding-window layers keep a block's K/V: blocks of their own, freed once every
sequence holding the block has moved past it.

A sliding layer (Gemma 3, Mistral) reads only the last ``window`` positions, so it needs
no block older than that: its pools hold :attr:`WindowBlocks.num_blocks` blocks, a few
windows' worth per running sequence, while the global layers keep every token. Each block
of the shared block tables (the full layers' blocks) maps to a window block while some
sequence may still read it there, else to :attr:`WindowBlocks.trash`, a block nobody
owns: a read of it is always outside the reader's window, masked, and a stray write is
harmless. The block tables stay one per sequence, so the layouts, prefix reuse and
rollback keep their rules; the sliding layers read the same tables through :meth:`slots`
or :meth:`layout_of`.

A window block whose last holder leaves keeps its contents and its mapping until it is
handed out again (least recently freed first), as :class:`.block_pool.BlockPool` keeps
a freed block's hash: a request whose prefix is found in the cache then reuses the sliding
layers' K/V too, when the blocks of its last window are still there.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .block_pool import NoFreeBlocks
from .layout import AttentionLayout


class WindowBlocks:
    """``num_blocks`` window blocks for ``num_table_blocks`` blocks of the block tables;
    ``window``: the widest sliding window (a query at ``p`` reads keys after ``p - window``)."""

    def __init__(self, num_blocks: int, num_table_blocks: int, block_size: int, window: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.window = window
        #: the window block no table block owns (the pools hold ``num_blocks + 1`` blocks)
        self.trash = num_blocks
        self.block_of = [self.trash] * num_table_blocks
        #: :attr:`block_of` as a tensor, for the slots a compiled graph reads
        self.block_map = torch.full((num_table_blocks,), self.trash, dtype=torch.long)
        self.ref_count = [0] * num_blocks
        self.owner: list[int | None] = [None] * num_blocks
        self.free_blocks: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def released_before(self, num_computed: int) -> int:
        """How many leading blocks a sequence with ``num_computed`` committed tokens no
        longer reads: its next query, at ``num_computed``, sees keys from ``num_computed -
        window + 1`` on, and rollback never goes below the committed length."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def _map(self, table_block: int, window_block: int) -> None:
        self.block_of[table_block] = window_block
        self.block_map[table_block] = window_block

    def allocate(self, table_blocks: list[int]) -> None:
        """A window block of its own, held once, for each of ``table_blocks`` (new blocks)."""
        if len(table_blocks) > len(self.free_blocks):
            raise NoFreeBlocks(f"need {len(table_blocks)} sliding-window blocks, {len(self.free_blocks)} free")
        for block in table_blocks:
            w, _ = self.free_blocks.popitem(last=False)
            old = self.owner[w]
            if old is not None and self.block_of[old] == w:
                self._map(old, self.trash)
            self.ref_count[w] = 1
            self.owner[w] = block
            self._map(block, w)

    def is_live(self, table_block: int) -> bool:
        """Whether the sliding layers still hold ``table_block``'s K/V."""
        return self.block_of[table_block] != self.trash

    def hold(self, table_block: int) -> None:
        """One more sequence reads ``table_block`` (live) through its window."""
        w = self.block_of[table_block]
        if self.ref_count[w] == 0:
            del self.free_blocks[w]
        self.ref_count[w] += 1

    def release(self, table_blocks: list[int]) -> None:
        """A sequence no longer reads ``table_blocks`` through its window."""
        for block in reversed(table_blocks):
            w = self.block_of[block]
            self.ref_count[w] -= 1
            if self.ref_count[w] == 0:
                self.free_blocks[w] = None

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The window pools' slots of the block tables' ``slots`` (a tensor of them)."""
        size = self.block_size
        return self.block_map.to(slots.device)[slots // size] * size + slots % size

    def layout_of(self, layout: AttentionLayout) -> AttentionLayout:
        """``layout`` over the window blocks (built once per step)."""
        remapped = layout.kernel_cache.get("window")
        if remapped is None:
            remapped = layout.kernel_cache["window"] = layout.remapped(self.block_of)
        return remapped
