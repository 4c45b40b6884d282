"""The module shipped for the embedded model: the default for mtp on it; greedy output
identical to plain greedy in float32 with drafts accepted; sampled output follows the
target's distribution."""

from specdec import testing
from specdec_mtp import SHIPPED_MODULE

#: Acceptance length floor on the check prompts (measured 1.455 in float32 with 3 drafts every
#: step; EAGLE-3's shipped head: 1.433; a module that predicts nothing: 1.0).
MIN_LENGTH = 1.35


def test_shipped_module_is_lossless_and_accepted():
    spec, _ = testing.check_shipped_drafter({"decoding_type": "mtp"}, MIN_LENGTH)
    assert spec.drafter.directory == SHIPPED_MODULE and spec.config.speculative_config.max_draft_len == 3


def test_sampled_output_follows_the_target():
    assert testing.check_shipped_sampling({"decoding_type": "mtp", "speculative_model": str(SHIPPED_MODULE),
                                           "max_draft_len": 2}) > 0


def test_a_prompt_found_in_the_prefix_cache_drafts_as_when_computed():
    """The module reads every prompt token's hidden state: the engine hands it those of the
    cached prefix, so a repeated prompt drafts and accepts exactly as the first time."""
    testing.check_shipped_prefix_cache({"decoding_type": "mtp"})
