"""The heads shipped for the embedded model: the default for medusa on it; greedy output
identical to plain greedy on the default target with drafts accepted, as the default tree
and as a chain; sampled output follows the target's distribution; typical acceptance is
opt-in and labelled lossy."""

import json

import pytest
from specdec_medusa import SHIPPED_HEADS
from specdec_test_support import embedded

from specdec import LLM, SamplingParams
from specdec.cli import main

PROMPTS = embedded.SHIPPED_CHECK_PROMPTS


@pytest.mark.parametrize("mode, min_length", [
    ({}, 1.35),  # measured 1.52 with AVX-512, 1.433 with AVX2 only
    ({"medusa_choices": [[0, 0, 0]]}, 1.2),  # 1.26
])
def test_shipped_heads_are_lossless_and_accepted(mode, min_length):
    spec, _ = embedded.check_shipped_drafter({"decoding_type": "medusa", **mode}, min_length)
    assert (SHIPPED_HEADS / "config.json").exists() and spec.drafter.heads.shares_lm_head


@pytest.mark.parametrize("mode", [{"medusa_choices": [[0, 0]]}, {"medusa_choices": [[0, 0], [1], [0, 1]]}])
def test_sampled_output_follows_the_target(mode):
    # adaptive off: three-token requests end before the planner has evidence to draft
    assert embedded.check_shipped_sampling({"decoding_type": "medusa", "speculative_model": str(SHIPPED_HEADS),
                                           "max_draft_len": 2, "adaptive": False, **mode}) > 0


def test_typical_acceptance_is_opt_in_and_labelled_lossy(capsys):
    assert main(["plugins", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    medusa = next(m for m in listed["decoding_types"] if m["name"] == "medusa")
    assert medusa["lossy_options"] == ["use_typical_acceptance"]
    params = SamplingParams(max_tokens=16, temperature=0.7, seed=0)
    exact = LLM(speculative_config={"decoding_type": "medusa"}).chat(PROMPTS[:1], params)[0]
    typical = LLM(speculative_config={"decoding_type": "medusa", "use_typical_acceptance": True})
    out = typical.chat(PROMPTS[:1], params)[0]
    assert exact.metrics.lossless and not out.metrics.lossless


def test_heads_draft_from_a_prompt_found_in_the_prefix_cache():
    """The heads read the newest token's hidden state only: no states are kept for cached
    prefixes, and a repeated prompt served from the cache drafts as the first time."""
    embedded.check_shipped_prefix_cache({"decoding_type": "medusa"})


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with the heads' static tree, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "medusa"})
