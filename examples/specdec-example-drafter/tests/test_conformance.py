"""The example plugin passes specdec's conformance kit, installed for real."""

from specdec import LLM, SamplingParams, testing


def test_registered_through_its_entry_point():
    dtype = testing.check_registration("bigram", distribution="specdec-example-drafter")
    assert dtype.hooks_implemented() == ["prepare_draft_tokens"]


def test_config_round_trip():
    config = testing.check_config_round_trip({"decoding_type": "bigram", "max_draft_len": 3, "smoothing": 0.5})
    assert config.smoothing == 0.5


def test_greedy_lossless_and_accepted_on_the_embedded_model():
    """A random tiny model never repeats itself, so a bigram drafter cannot predict it; the
    embedded model continues a repeated phrase, which the bigrams of the context predict."""
    outs = testing.check_greedy_lossless({"decoding_type": "bigram", "max_draft_len": 3},
                                         prompts=["Repeat: one two three four. one two three four. one two"])
    assert outs[0].metrics.num_accepted_tokens >= 3  # measured 3 of 12 (float32, deterministic)


def test_sampled_drafts_with_probabilities_keep_the_target_distribution(tmp_path):
    """Drafts sampled with their probabilities go through rejection sampling: the output's
    second token follows the target's exact distribution (chi-square), drafts accepted."""
    model = testing.tiny_model_dir(tmp_path)
    _, accepted = testing.check_sampling_lossless({"decoding_type": "bigram", "max_draft_len": 3}, model,
                                                  prompt=list(range(10)) * 3, n=600)
    assert accepted > 0
    # A seed reproduces sampled output when the draft lengths repeat too: the adaptive
    # planner's lengths follow measured step times, so it is off here.
    llm = LLM(model=str(model), dtype="float32",
              speculative_config={"decoding_type": "bigram", "max_draft_len": 3, "adaptive": False})
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, ignore_eos=True)
    out, again = (llm.generate([list(range(20)) * 2], params)[0] for _ in range(2))
    assert again.token_ids == out.token_ids and out.metrics.num_draft_tokens > 0  # same seed, same output
