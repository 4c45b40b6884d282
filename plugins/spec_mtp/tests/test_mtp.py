"""The module shipped for the embedded model: the default for mtp on it; greedy output
identical to plain greedy on the default target with drafts accepted, as EAGLE-2 dynamic
trees (the default) and as chains; sampled output follows the target's distribution."""

import pytest
from specdec_mtp import SHIPPED_MODULE
from specdec_test_support import embedded

from specdec import LLM

#: Chains only (the dynamic tree is the default).
CHAIN = {"use_dynamic_tree": False}


@pytest.mark.parametrize("mode, min_length", [
    # Acceptance length floors on the check prompts (a module that predicts nothing: 1.0)
    ({}, 1.7),  # the default dynamic tree (depth 3, top-3, 10 nodes): measured 1.882
    (CHAIN, 1.45),  # measured 1.600 with 3 drafts every step
])
def test_shipped_module_is_lossless_and_accepted(mode, min_length):
    spec, _ = embedded.check_shipped_drafter({"decoding_type": "mtp", **mode}, min_length)
    assert spec.drafter.directory == SHIPPED_MODULE and spec.config.speculative_config.max_draft_len == 3
    got = spec.chat(embedded.SHIPPED_CHECK_PROMPTS[:1], embedded.SHIPPED_CHECK_PARAMS)[0].metrics
    nodes_per_step = got.num_draft_tokens / got.drafted_at[0]
    assert nodes_per_step <= 3 if mode == CHAIN else nodes_per_step > 3  # trees verify more nodes than their depth


@pytest.mark.parametrize("mode", [CHAIN, {"dynamic_tree_max_topK": 2, "max_total_draft_tokens": 4}])
def test_sampled_output_follows_the_target(mode):
    assert embedded.check_shipped_sampling({"decoding_type": "mtp", "speculative_model": str(SHIPPED_MODULE),
                                           "max_draft_len": 2, **mode}) > 0


def test_a_prompt_found_in_the_prefix_cache_drafts_as_when_computed():
    """The module reads every prompt token's hidden state: the engine hands it those of the
    cached prefix, so a repeated prompt drafts and accepts exactly as the first time."""
    embedded.check_shipped_prefix_cache({"decoding_type": "mtp"})


def test_the_adaptive_planner_drafts_chains_and_trees_without_changing_greedy_output():
    """By default (a dynamic tree, the adaptive planner on) each step and request gets the
    chain or the tree, whichever the live estimates say pays more: on the check prompts
    both shapes are verified, drafts are accepted, and the output is plain greedy. The
    planner learns step times from a fixed CPU-like cost model, not the clock: under load
    measured times may make drafting never pay."""
    from specdec.drafting.interface import TREE_KIND

    spec = LLM(speculative_config={"decoding_type": "mtp"})
    embedded.steady_costs(spec)
    got = spec.chat(embedded.SHIPPED_CHECK_PROMPTS, embedded.SHIPPED_CHECK_PARAMS)
    assert [o.token_ids for o in got] == [o.token_ids for o in embedded.embedded_plain_chat()]
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    verified = spec.engine.planner.stats.counts
    assert TREE_KIND in verified and None in verified, verified.keys()


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with the module's drafts, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "mtp"})
