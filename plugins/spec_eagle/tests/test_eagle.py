"""The heads shipped for the embedded model: the default for eagle / eagle3 on it; greedy
output identical to plain greedy in float32 with many drafts accepted, as chains, static
trees and dynamic trees; sampled output follows the target's distribution; preemption
(the draft cache rolled back to where the target recomputes) keeps output unchanged."""

import pytest

from specdec import LLM, SamplingParams, testing
from specdec.models import resolve_model_dir
from specdec_eagle import SHIPPED_HEADS

PROMPTS = [[{"role": "user", "content": "Explain why the sky looks blue, in two sentences."}],
           [{"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes? Think step by step."}]]
PARAMS = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32").chat(PROMPTS, PARAMS)


@pytest.mark.parametrize("name, mode, min_length", [
    ("eagle3", {}, 1.35),  # measured 1.46 (an untrained head: about 1.0)
    ("eagle3", {"eagle_choices": [[0, 0, 0], [0, 1], [1, 0], [2]]}, 1.5),  # 1.63
    ("eagle3", {"use_dynamic_tree": True, "dynamic_tree_max_topK": 3, "max_total_draft_tokens": 10}, 1.5),  # 1.66
    ("eagle", {}, 1.3),  # 1.39
])
def test_shipped_heads_are_lossless_and_accepted(plain, name, mode, min_length):
    # the heads' acceptance at their full draft shape: the adaptive planner would trim it
    spec = LLM(dtype="float32", speculative_config={"decoding_type": name, "adaptive": False, **mode})
    assert (SHIPPED_HEADS[3 if name == "eagle3" else 1] / "config.json").exists()
    got = spec.chat(PROMPTS, PARAMS)
    for a, b in zip(plain, got):
        assert b.token_ids == a.token_ids
    steps = sum(o.metrics.num_steps for o in got)
    length = sum(len(o.token_ids) for o in got) / steps
    assert length >= min_length, (name, mode, length)
    assert spec.drafter.runner.kv.pool.num_free == spec.drafter.runner.kv.pool.num_blocks  # released


@pytest.mark.parametrize("mode", [{}, {"eagle_choices": [[0, 0], [1], [2]]}])
def test_sampled_output_follows_the_target(mode):
    path = resolve_model_dir(None)
    llm = LLM(dtype="float32")
    prompt = llm.apply_chat_template([{"role": "user", "content": "Name a color."}])
    _, accepted = testing.check_sampling_lossless(
        {"decoding_type": "eagle3", "speculative_model": str(SHIPPED_HEADS[3]), "max_draft_len": 2, **mode},
        path, prompt=prompt, n=250, params=SamplingParams(temperature=1.0, top_k=4))
    assert accepted > 0


def test_preempted_requests_rebuild_the_draft_cache_and_stay_lossless(plain):
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
