"""The example plugin passes specdec's conformance kit, installed for real."""

import torch

from specdec import LLM, SamplingParams, testing


def test_registered_through_its_entry_point():
    dtype = testing.check_registration("bigram", distribution="specdec-example-drafter")
    assert dtype.hooks_implemented() == ["prepare_draft_tokens"]


def test_config_round_trip():
    config = testing.check_config_round_trip({"decoding_type": "bigram", "max_draft_len": 3, "smoothing": 0.5})
    assert config.smoothing == 0.5


def test_greedy_lossless_on_tiny_model(tmp_path):
    outs = testing.check_greedy_lossless({"decoding_type": "bigram", "max_draft_len": 3},
                                         model=testing.tiny_model_dir(tmp_path))
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


def test_sampled_drafts_with_probabilities_run_through_rejection_sampling(tmp_path):
    llm = LLM(model=str(testing.tiny_model_dir(tmp_path)), dtype="float32",
              speculative_config={"decoding_type": "bigram", "max_draft_len": 3})
    out = llm.generate([list(range(20)) * 2], SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                             ignore_eos=True))[0]
    assert len(out.token_ids) == 30
    assert out.metrics.num_draft_tokens > 0
    again = llm.generate([list(range(20)) * 2], SamplingParams(max_tokens=30, temperature=1.0, seed=3,
                                                               ignore_eos=True))[0]
    assert again.token_ids == out.token_ids  # same seed, same output
    assert torch.tensor(out.token_ids).max() < 128
