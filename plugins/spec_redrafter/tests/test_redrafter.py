"""The drafter shipped for the embedded model: the default for redrafter on it; greedy
output identical to plain greedy on the default target with drafts accepted, as beams and
as a chain;
sampled output follows the target's distribution."""

import pytest
from specdec_redrafter import SHIPPED_DRAFTER
from specdec_test_support import embedded


# 96 tokens are few: measured 1.745 / 1.600 on a CPU with AVX-512, 1.548 / 1.412 on one
# with AVX2 only, while over six diverse prompts (scripts/profile_draft.py) the drafter's
# acceptance is 1.54 on both.
@pytest.mark.parametrize("mode, min_length", [
    ({}, 1.45),
    ({"beam_width": 1}, 1.3),
])
def test_shipped_drafter_is_lossless_and_accepted(mode, min_length):
    spec, _ = embedded.check_shipped_drafter({"decoding_type": "redrafter", **mode}, min_length)
    assert (SHIPPED_DRAFTER / "config.json").exists() and spec.drafter.model.shape.shares_lm_head


@pytest.mark.parametrize("width", [1, 3])
def test_sampled_output_follows_the_target(width):
    assert embedded.check_shipped_sampling({"decoding_type": "redrafter", "speculative_model": str(SHIPPED_DRAFTER),
                                           "max_draft_len": 2, "beam_width": width}) > 0


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with the beams, verified as a tree, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "redrafter"})
