"""Sliding-window layers on blocks of their own: a block leaves them once every sequence
holding it has moved past it, and what a model computes does not change."""

import pytest
import torch

from conftest import reference_greedy, stock_model
from specdec import LLM, SamplingParams, testing
from specdec.kvcache import KVCacheManager, PagedKVCache


class Seq:
    def __init__(self, tokens):
        self.token_ids = list(tokens)
        self.num_computed = 0
        self.block_table = []
        self.window_from = 0


def manager(num_blocks=32, window_blocks=6, block_size=4, window=8):
    """Two layers, the first sliding over ``window`` positions."""
    cache = PagedKVCache([(1, 2, 2), (1, 2, 2)], num_blocks, block_size, torch.float32, torch.device("cpu"),
                         [window, None], window_blocks)
    return KVCacheManager(cache, num_blocks, block_size, True)


def test_the_sliding_layers_pools_hold_only_their_window_blocks():
    kv = manager()
    assert kv.cache.keys[0].shape[0] == (6 + 1) * 4  # the window blocks and the trash block
    assert kv.cache.keys[1].shape[0] == 32 * 4 + 1  # every block, and the scratch slot


def test_blocks_leave_the_window_as_the_sequence_moves_past_them():
    kv = manager()
    seq = Seq(range(40))
    kv.reserve(seq, 10)
    kv.commit(seq, 10)
    assert kv.windows.num_free == 6 - 3
    # a query at 10 sees keys 3..10: block 0 (positions 0..3) is still read
    assert seq.window_from == 0
    kv.reserve(seq, 2)
    kv.commit(seq, 12)  # the next query, at 12, sees 5..12: block 0 is left behind
    assert seq.window_from == 1 and kv.windows.num_free == 6 - 2
    for n in range(13, 29):
        kv.reserve(seq, 1)
        kv.commit(seq, n)
    assert len(seq.block_table) == 7  # more blocks than the window pool holds
    assert seq.window_from == (28 - 8 + 1) // 4
    assert kv.windows.num_free == 6 - (7 - seq.window_from)
    live = [b for b in seq.block_table if kv.windows.is_live(b)]
    assert seq.block_table[seq.window_from:] == live[-(7 - seq.window_from):]
    kv.free(seq)
    assert kv.windows.num_free == 6 and kv.pool.num_free == 32


def test_a_rollback_releases_the_window_blocks_of_the_dropped_drafts():
    kv = manager()
    seq = Seq(range(40))
    kv.reserve(seq, 8)
    kv.commit(seq, 8)
    kv.reserve(seq, 9)  # a root and eight drafts: three more blocks
    assert kv.windows.num_free == 6 - 5
    kv.commit(seq, 10)  # two kept
    assert len(seq.block_table) == 3 and kv.windows.num_free == 6 - 3 + seq.window_from


def test_a_window_block_handed_out_again_leaves_its_old_block_behind():
    kv = manager()
    a = Seq(range(100, 140))
    kv.reserve(a, 24)
    kv.commit(a, 24)  # blocks 0..3 left the window; their window blocks are free
    old = a.block_table[:a.window_from]
    assert all(kv.windows.is_live(b) for b in old)  # kept until handed out again
    b = Seq(range(24))
    kv.reserve(b, 16)
    assert not any(kv.windows.is_live(block) for block in old)
    slots = kv.windows.slots(torch.tensor([old[0] * 4 + 1, b.block_table[0] * 4 + 3]))
    assert slots[0] == kv.windows.trash * 4 + 1
    assert slots[1] == kv.windows.block_of[b.block_table[0]] * 4 + 3


def test_a_cached_prefix_is_reused_only_up_to_where_its_last_window_is_still_held():
    kv = manager(window_blocks=8)
    prompt = list(range(100, 130))
    a = Seq(prompt)
    kv.reserve(a, 28)
    kv.commit(a, 28)
    kv.free(a)
    # nothing has taken the window blocks back: the whole cached prefix is reused, its
    # last window held again
    again = Seq(prompt)
    assert kv.attach_prefix(again) == 28
    assert again.window_from == (28 - 8 + 1) // 4
    assert kv.windows.num_free == 8 - (7 - again.window_from)
    kv.free(again)
    # another request takes every window block: blocks 0..6 of the prompt left the sliding
    # layers, so the sliding layers of the last window must be computed again
    other = Seq(range(200, 240))
    kv.reserve(other, 32)
    assert kv.windows.num_free == 0
    kv.free(other)
    late = Seq(prompt)
    assert kv.attach_prefix(late) == 0
    assert kv.pool.num_free == 32 and kv.windows.num_free == 8


WINDOW_ENGINE = {"block_size": 4, "max_batch_size": 2, "max_num_tokens": 16, "kv_cache_blocks": 96}


def _window_engine(arch_dir, **engine):
    """Block size 4 and room for two requests of 16-token steps: every window block is
    handed out many times over in these tests."""
    return LLM(model=str(arch_dir), dtype="float32", engine={**WINDOW_ENGINE, **engine})


PROMPTS = [list(range(3, 40)), [40, 41, 42, 43, 44] * 8, list(range(60, 90))]  # longer than the window of 8


@pytest.mark.parametrize("arch", ["gemma3_text", "mistral"])
def test_greedy_output_equals_the_stock_models_with_window_blocks_reused(tiny_models, arch):
    llm = _window_engine(tiny_models[arch])
    cache = llm.engine.kv.cache
    windows = cache.window_blocks
    assert windows is not None and windows.num_blocks == 2 * (2 + 3) + 4
    assert cache.keys[0].shape[0] == (windows.num_blocks + 1) * 4 < cache.keys[-1].shape[0] or arch == "mistral"
    outs = llm.generate(PROMPTS + PROMPTS[:1], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    ref = stock_model(tiny_models[arch])
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 24), f"{arch}: prompt {prompt}"
    assert outs[3].token_ids == outs[0].token_ids
    assert windows.num_free == windows.num_blocks


def test_requests_preempted_and_recomputed_over_window_blocks_answer_as_alone(tiny_models):
    """Three long requests in a cache too small for them together: the newest is preempted,
    its blocks and window blocks freed, and it comes back through the prefix cache (up to
    where its last window is still held) to the same greedy answer."""
    llm = _window_engine(tiny_models["gemma3_text"], max_batch_size=3, kv_cache_blocks=44)
    windows = llm.engine.kv.cache.window_blocks
    assert windows is not None and windows.num_blocks == 3 * (2 + 3) + 4
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    ref = stock_model(tiny_models["gemma3_text"])
    for prompt, out in zip(PROMPTS, outs):
        assert out.token_ids == reference_greedy(ref, prompt, 32)
    assert windows.num_free == windows.num_blocks and llm.engine.kv.pool.num_free == 44


def test_chains_accepted_and_rolled_back_over_window_blocks_are_lossless(tiny_models):
    outs = testing.check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, tiny_models["gemma3_text"],
                                         prompts=PROMPTS, max_tokens=32, min_accepted=10, engine=WINDOW_ENGINE)
    assert outs[0].metrics.num_draft_tokens > outs[0].metrics.num_accepted_tokens  # drafts rolled back too


def test_tree_paths_compacted_over_window_blocks_are_lossless(tiny_models):
    """Trees holding the true continuation beside decoys: the accepted path's K/V moves
    down in the window pools as in the others."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = _window_engine(tiny_models["gemma3_text"]).generate(PROMPTS, params)
    oracle = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    spec = {"decoding_type": "user", "drafter": "helpers:OracleDrafter", "max_draft_len": 3,
            "options": {"tree": True, "seed": 2, "oracle": oracle}}
    testing.check_greedy_lossless(spec, model=tiny_models["gemma3_text"], prompts=PROMPTS, min_accepted=10,
                                  engine=WINDOW_ENGINE)


def test_the_compiled_batch_invariant_graph_reads_the_window_blocks(tiny_models, monkeypatch):
    """The CPU kernel called from one compiled graph (what the default target runs), its
    sliding layers over the window pools' slots, answers as the same graph over one pool
    that keeps every token, and its first token's log-probabilities after prompts longer
    than the window are the eager engine's. (Not its whole answers: inductor's float32
    fusions differ from eager code by an ulp here and there, and on CPUs without AVX-512
    one such ulp flips an activation's int8 rounding within 24 tokens of this random model.)"""
    from specdec.executor import kv_budget
    from specdec.kernels import cpu

    if not cpu.kernel_available():
        pytest.skip("the CPU attention kernel is not built here")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine = {"quantization": "w4a8", "batch_invariant": True, "compile": True}
    llm = _window_engine(tiny_models["gemma3_text"], **engine)
    assert llm.engine.compiled and llm.engine.kv.cache.window_blocks is not None
    outs = llm.generate(PROMPTS, params)
    monkeypatch.setattr(kv_budget, "window_blocks_needed", lambda config, window: 10**9)  # more than the cache
    whole = _window_engine(tiny_models["gemma3_text"], **engine)
    assert whole.engine.compiled and whole.engine.kv.cache.window_blocks is None
    assert [o.token_ids for o in outs] == [o.token_ids for o in whole.generate(PROMPTS, params)]
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    eager = _window_engine(tiny_models["gemma3_text"], **engine | {"compile": False}).generate(PROMPTS, first)
    for got, want in zip(llm.generate(PROMPTS, first), eager):
        assert got.token_ids == want.token_ids and got.logprobs[0].keys() == want.logprobs[0].keys()
        assert all(abs(got.logprobs[0][t] - lp) < 1e-4 for t, lp in want.logprobs[0].items())


def test_the_kv_budget_gives_what_the_windows_leave_to_the_layers_that_keep_every_token(tiny_models):
    """Two of the tiny Gemma 3's three layers slide: the same memory holds about three
    times the context of a cache that keeps every layer's history."""
    llm = _window_engine(tiny_models["gemma3_text"], kv_cache_blocks=None, kv_cache_memory_mb=4)
    cache, budget = llm.engine.kv.cache, 4 * 2**20
    held = sum(t.numel() * t.element_size() for t in (*cache.keys, *cache.values))
    whole = budget // (4 * PagedKVCache.bytes_per_token(llm.engine.target.layer_shapes, torch.float32))
    assert budget - 4096 < held <= budget + 2 * 4096  # the trash block and the scratch slot past it
    assert llm.engine.kv.pool.num_blocks > 2.9 * whole


def test_metrics_report_the_window_pools_blocks_and_their_use(tiny_models):
    from specdec.serving.async_engine import engine_stats
    from specdec.serving.metrics import ServerMetrics

    llm = _window_engine(tiny_models["gemma3_text"])
    engine = llm.engine
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt's first chunk holds window blocks now
    held = engine_stats(engine)
    assert held["kv_window_blocks"] == 14 and held["kv_window_usage"] == engine.kv.windows.usage() > 0
    while engine.has_unfinished():
        engine.step()
    exposed = ServerMetrics().render(engine_stats(engine), 0).decode()
    assert "specdec_kv_window_blocks 14.0" in exposed and "specdec_kv_window_usage 0.0" in exposed
    plain = ServerMetrics().render(engine_stats(_window_engine(tiny_models["llama"]).engine), 0).decode()
    assert "specdec_kv_window_blocks 0.0" in plain
