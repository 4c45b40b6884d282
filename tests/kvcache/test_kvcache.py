"""Block pool and block tables: allocation, rollback, prefix reuse, compaction."""

import pytest
import torch

from specdec.kvcache import BlockPool, KVCacheManager, NoFreeBlocks, PagedKVCache


class Seq:
    def __init__(self, tokens):
        self.token_ids = list(tokens)
        self.num_computed = 0
        self.block_table = []


def manager(num_blocks=8, block_size=4, prefix=True):
    cache = PagedKVCache([(1, 2, 2)], num_blocks, block_size, torch.float32, torch.device("cpu"))
    return KVCacheManager(cache, num_blocks, block_size, prefix)


def test_allocate_and_free_return_every_block():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(3)
    assert pool.num_free == 1 and len(set(blocks)) == 3
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.free(blocks)
    assert pool.num_free == 4


def test_rollback_frees_blocks_past_the_committed_length():
    kv = manager()
    seq = Seq(range(10))
    kv.reserve(seq, 10)
    assert len(seq.block_table) == 3
    kv.commit(seq, 10)
    kv.reserve(seq, 7)  # drafts
    assert len(seq.block_table) == 5
    kv.commit(seq, 11)  # one accepted
    assert len(seq.block_table) == 3 and kv.pool.num_free == 5


def test_prefix_blocks_are_shared_by_content_and_ref_counted():
    kv = manager()
    a = Seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    kv.reserve(a, 10)
    kv.commit(a, 10)  # two full blocks hashed, the third partial and private
    b = Seq([1, 2, 3, 4, 5, 6, 7, 8, 42])
    assert kv.attach_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert kv.pool.ref_count[a.block_table[0]] == 2
    c = Seq([1, 2, 3, 4, 9, 9, 9, 9, 9])
    assert kv.attach_prefix(c) == 4  # only the first block matches
    kv.free(a)
    assert kv.pool.ref_count[b.block_table[0]] == 2  # still used by b and c
    kv.free(b)
    kv.free(c)
    assert kv.pool.num_free == 8


def test_whole_prompt_match_leaves_the_last_token_to_compute():
    kv = manager()
    a = Seq(range(8))
    kv.reserve(a, 8)
    kv.commit(a, 8)
    b = Seq(range(8))
    assert kv.attach_prefix(b) == 4  # not 8: the step needs logits of the last token


def test_freed_blocks_keep_their_contents_for_later_reuse_until_reallocated():
    kv = manager(num_blocks=3)
    a = Seq(range(8))
    kv.reserve(a, 8)
    kv.commit(a, 8)
    kv.free(a)
    b = Seq([*range(8), 99])
    assert kv.attach_prefix(b) == 8
    kv.free(b)
    kv.pool.allocate(3)  # overwrites them
    assert kv.attach_prefix(Seq([*range(8), 99])) == 0


def test_no_sharing_when_prefix_caching_is_off():
    kv = manager(prefix=False)
    a = Seq(range(8))
    kv.reserve(a, 8)
    kv.commit(a, 8)
    assert kv.attach_prefix(Seq(range(9))) == 0


def test_pool_too_small_is_reported():
    kv = manager(num_blocks=2, block_size=4)
    from specdec.errors import KVCacheFullError
    with pytest.raises(KVCacheFullError, match="whole pool holds 8"):
        kv.check_fits(9)


def test_compaction_moves_kv_rows():
    kv = manager()
    seq = Seq(range(6))
    kv.reserve(seq, 6)
    slots = kv.slots(seq, 0, 6)
    for i, s in enumerate(slots):
        kv.cache.keys[0][s] = i
        kv.cache.values[0][s] = -i
    kv.move([slots[5], slots[3]], [slots[1], slots[2]], torch.device("cpu"))
    assert kv.cache.keys[0][slots[1]].flatten().tolist() == [5.0, 5.0]
    assert kv.cache.values[0][slots[2]].flatten().tolist() == [-3.0, -3.0]


def _resident_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_cpu_pool_takes_memory_only_where_written_and_gives_it_back():
    """Pools of 768 MiB of zeros cost no resident memory until used: writing a block commits
    about that block, filling a pool commits it, and dropping the pools hands their pages
    back."""
    import gc

    from specdec.kvcache import HiddenStateCache

    mib = 1 << 20
    gc.collect()
    before = _resident_bytes()
    cache = PagedKVCache([(2, 64, 64)] * 8, 1024, 32, torch.float32, torch.device("cpu"))  # 16 x 16 MiB
    states = HiddenStateCache([0, -1], 1024 * 32, 2048, torch.float32, torch.device("cpu"))  # 2 x 256 MiB
    assert _resident_bytes() - before < 16 * mib
    assert not any(t[::1024].any() for t in cache.keys + cache.values + list(states.states.values()))
    slots = torch.arange(64, 128)
    cache.keys[3][slots] = 1.0
    states.write(slots, {0: torch.ones(64, 2048), -1: torch.ones(64, 2048)})
    assert cache.keys[3][slots].all() and not cache.keys[3][:64].any() and states.read(slots)[-1].all()
    assert _resident_bytes() - before < 32 * mib
    for t in cache.keys + cache.values:
        t.fill_(2.0)
    assert _resident_bytes() - before > 240 * mib
    del cache, states, t
    gc.collect()
    assert _resident_bytes() - before < 32 * mib
