"""The heads shipped for the embedded model: the default for eagle / eagle3 on it; greedy
output identical to plain greedy on the default target with many drafts accepted, as
chains, static trees and dynamic trees; sampled output follows the target's distribution;
preemption (the draft cache rolled back to where the target recomputes) keeps output
unchanged."""

import pytest
from specdec_eagle import SHIPPED_HEADS
from specdec_test_support import embedded

from specdec import LLM

PROMPTS = embedded.SHIPPED_CHECK_PROMPTS
PARAMS = embedded.SHIPPED_CHECK_PARAMS


@pytest.mark.parametrize("name, mode, min_length", [
    ("eagle3", {"min_chain_probability": 0.0}, 1.4),  # 1.50 at full depth (an untrained head: about 1.0)
    ("eagle3", {"eagle_choices": [[0, 0, 0], [0, 1], [1, 0], [2]]}, 1.6),  # 1.75
    ("eagle3", {"use_dynamic_tree": True, "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 10}, 1.65),  # 1.81
    ("eagle", {"min_chain_probability": 0.0}, 1.3),  # 1.37 at full depth (1.26 stopping at 0.5, the default)
])
def test_shipped_heads_are_lossless_and_accepted(name, mode, min_length):
    spec, _ = embedded.check_shipped_drafter({"decoding_type": name, **mode}, min_length)
    assert (SHIPPED_HEADS[3 if name == "eagle3" else 1] / "config.json").exists()
    assert spec.drafter.runner.kv.pool.num_free == spec.drafter.runner.kv.pool.num_blocks  # released


def test_chains_that_stop_on_their_draft_probability_are_lossless_and_end_at_both_depths():
    """The default chain of up to three levels, which stops once its draft probability
    falls below 0.5: output equals plain greedy output with drafts accepted, some chains
    stop after their first level and some grow all three (measured 48, 15 and 3 steps at
    depths 1-3)."""
    spec, _ = embedded.check_shipped_drafter({"decoding_type": "eagle3"}, 1.3)
    assert spec.config.speculative_config.min_chain_probability == 0.5
    got = spec.chat(PROMPTS, PARAMS)
    depths = [sum(o.metrics.draft_len_counts[d] for o in got if d < len(o.metrics.draft_len_counts))
              for d in range(4)]
    assert depths[1] > 0 and depths[3] > 0, depths
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0


@pytest.mark.parametrize("mode", [{}, {"eagle_choices": [[0, 0], [1], [2]]}])
def test_sampled_output_follows_the_target(mode):
    assert embedded.check_shipped_sampling({"decoding_type": "eagle3", "speculative_model": str(SHIPPED_HEADS[3]),
                                           "max_draft_len": 2, **mode}) > 0


def test_sampled_constrained_output_follows_the_masked_target():
    """EAGLE-3's drafts are drawn from its own distribution, so a draft the grammar
    forbids is verified and rejected (the masked target gives it 0), not pruned."""
    assert embedded.check_structured_sampling({"decoding_type": "eagle3", "speculative_model": str(SHIPPED_HEADS[3]),
                                              "max_draft_len": 2}) > 0


def test_preempted_requests_rebuild_the_draft_cache_and_stay_lossless():
    # float32, eager: on the default target this small cache's engine took 80 s, caches empty
    plain = LLM(dtype="float32").chat(PROMPTS, PARAMS)
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
    embedded.check_shipped_prefix_cache({"decoding_type": name})


def test_rows_kept_while_off_are_fused_as_if_all_at_once(monkeypatch):
    """A request kept from drafting fuses the states of the rows it missed every
    ``UNFUSED_CHUNKS`` steps; what it would feed the draft layer on drafting again equals
    fusing every row in one go."""
    import torch

    import specdec.drafting.feature_drafter as feature_drafter
    from specdec import SamplingParams

    features = {}
    for every in (feature_drafter.UNFUSED_CHUNKS, 10**6):
        monkeypatch.setattr(feature_drafter, "UNFUSED_CHUNKS", every)
        llm = LLM(dtype="float32", speculative_config={"decoding_type": "eagle3", "draft_len_schedule": {1: 0}})
        req = llm.engine.add_request(llm.apply_chat_template(PROMPTS[0]),
                                     SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
        while req.num_output_tokens < 40:
            llm.engine.step()
        queue = req.drafter_state[llm.drafter.state_key]
        assert len(queue.tokens) == len(req.token_ids) - 1  # every row since the prompt's first, none drafted
        features[every] = (len(queue.fused), llm.drafter._features([queue])[0])
    (blocks, early), (none, at_once) = features.values()
    assert blocks >= 2 and none == 0
    assert early.shape == at_once.shape == (len(queue.tokens), llm.drafter.head.fc.out_features)
    # float32 products over 16 rows or 100 sum in other orders: 1.5e-4 apart here; a row out
    # of place or fused twice is off by the features' own size (about 1)
    torch.testing.assert_close(early, at_once, atol=1e-3, rtol=1e-3)
    # a request whose rows were all fused while off (it drafts right after a block)
    blocks_only = feature_drafter.FeatureQueue(tokens=list(range(len(queue.tokens))),
                                               fused=[at_once[:20], at_once[20:]])
    assert torch.equal(llm.drafter._features([blocks_only])[0], at_once)


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_structured_output_is_the_constrained_targets(name):
    """JSON-schema output with the dynamic draft tree: each node masked by its own path."""
    embedded.check_structured_lossless({"decoding_type": name})
