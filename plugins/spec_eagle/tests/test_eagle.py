"""The heads shipped for the embedded model: the default for eagle / eagle3 on it; greedy
output identical to plain greedy in float32 with many drafts accepted, as chains, static
trees and dynamic trees; sampled output follows the target's distribution; preemption
(the draft cache rolled back to where the target recomputes) keeps output unchanged."""

import pytest

from specdec import LLM, testing
from specdec_eagle import SHIPPED_HEADS

PROMPTS = testing.SHIPPED_CHECK_PROMPTS
PARAMS = testing.SHIPPED_CHECK_PARAMS


@pytest.mark.parametrize("name, mode, min_length", [
    ("eagle3", {}, 1.35),  # measured 1.46 (an untrained head: about 1.0)
    ("eagle3", {"eagle_choices": [[0, 0, 0], [0, 1], [1, 0], [2]]}, 1.5),  # 1.63
    ("eagle3", {"use_dynamic_tree": True, "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 10}, 1.5),  # 1.66
    ("eagle", {}, 1.3),  # 1.39
])
def test_shipped_heads_are_lossless_and_accepted(name, mode, min_length):
    spec, _ = testing.check_shipped_drafter({"decoding_type": name, **mode}, min_length)
    assert (SHIPPED_HEADS[3 if name == "eagle3" else 1] / "config.json").exists()
    assert spec.drafter.runner.kv.pool.num_free == spec.drafter.runner.kv.pool.num_blocks  # released


@pytest.mark.parametrize("mode", [{}, {"eagle_choices": [[0, 0], [1], [2]]}])
def test_sampled_output_follows_the_target(mode):
    assert testing.check_shipped_sampling({"decoding_type": "eagle3", "speculative_model": str(SHIPPED_HEADS[3]),
                                           "max_draft_len": 2, **mode}) > 0


def test_preempted_requests_rebuild_the_draft_cache_and_stay_lossless():
    plain = testing.embedded_plain_chat()
    llm = LLM(dtype="float32", engine={"kv_cache_blocks": 32, "block_size": 4, "max_batch_size": 4},
              speculative_config={"decoding_type": "eagle3"})
    preempted = []
    scheduler = llm.engine.scheduler
    original = scheduler._preempt
    scheduler._preempt = lambda victim: (preempted.append(victim.request_id), original(victim))
    prompts = PROMPTS * 2
    got = llm.chat(prompts, PARAMS)
    assert preempted, "the cache was large enough: nothing was preempted"
    for a, b in zip(plain * 2, got):
        assert b.token_ids == a.token_ids


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_a_prompt_found_in_the_prefix_cache_drafts_as_when_computed(name):
    """The draft layer reads every prompt token's features: the engine hands it those of
    the cached prefix, so a repeated prompt drafts and accepts exactly as the first time."""
    testing.check_shipped_prefix_cache({"decoding_type": name})
