"""spec_draft_target: lossless with a separate draft model and with a layer-skip self-draft."""

import pytest
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, testing
from specdec.errors import ModelLoadError


def with_tokenizer(directory, words):
    """Give a tiny model directory a word-level tokenizer over ``words``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dt")
    return testing.tiny_model_dir(root, seed=0, vocab_size=32), testing.tiny_model_dir(root, seed=1, vocab_size=32)


def test_conformance():
    testing.check_registration("draft_target", distribution="specdec-plugin-draft-target")
    testing.check_config_round_trip({"decoding_type": "draft_target", "max_draft_len": 3, "draft_layers": 2,
                                     "draft_kv_cache_blocks": 64})


def test_greedy_lossless_with_a_separate_draft_model(pair, tmp_path):
    """A separate draft directory holding the target's own weights: every draft is right,
    so each step emits max_draft_len + 1 tokens (but the last steps, cut by max_tokens)."""
    target, _ = pair
    draft = testing.tiny_model_dir(tmp_path, seed=0, vocab_size=32)
    outs = testing.check_greedy_lossless({"decoding_type": "draft_target", "speculative_model": str(draft),
                                          "max_draft_len": 3, "adaptive": False}, model=target,
                                         prompts=[[1, 2, 3, 4] * 3, [5, 9, 11], list(range(20))])
    for o in outs:
        assert o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens and o.metrics.acceptance_length > 3.5


def test_a_chain_stops_growing_below_its_draft_probability_floor(pair, tmp_path):
    """The target's own weights as the draft (every draft right) under a floor of 0.99,
    above any probability the tiny model gives: each chain stops after its first level."""
    target, _ = pair
    draft = testing.tiny_model_dir(tmp_path, seed=0, vocab_size=32)
    outs = testing.check_greedy_lossless({"decoding_type": "draft_target", "speculative_model": str(draft),
                                          "max_draft_len": 3, "adaptive": False, "min_chain_probability": 0.99},
                                         model=target, prompts=[[1, 2, 3, 4] * 3, [5, 9, 11]])
    for o in outs:
        assert o.metrics.draft_len_counts[2:] == [0] * len(o.metrics.draft_len_counts[2:]), o.metrics.draft_len_counts
        assert o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens > 0


def test_greedy_lossless_with_layer_skip_on_the_embedded_model():
    """An untrained first-N-layers draft of SmolLM2 is rarely accepted; the output must not change."""
    prompts = [[{"role": "user", "content": "List the planets of the solar system, one per line."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    # float32, eager: compiling a 20-layer draft graph for this one test costs a minute
    plain = LLM(dtype="float32").chat(prompts, params)
    spec = LLM(dtype="float32", speculative_config={"decoding_type": "draft_target", "draft_layers": 20,
                                                    "max_draft_len": 3, "adaptive": False})
    got = spec.chat(prompts, params)
    assert got[0].token_ids == plain[0].token_ids and len(got[0].token_ids) == 24
    assert got[0].metrics.num_draft_tokens > 0
    assert spec.drafter.runner.kv.pool.num_free == spec.drafter.runner.kv.pool.num_blocks  # released


def test_mismatched_tokenizer_names_both_models(tmp_path):
    target = with_tokenizer(testing.tiny_model_dir(tmp_path / "a", vocab_size=32), [f"w{i}" for i in range(32)])
    draft = with_tokenizer(testing.tiny_model_dir(tmp_path / "b", vocab_size=32), [f"v{i}" for i in range(32)])
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(target), speculative_config={"decoding_type": "draft_target", "speculative_model": str(draft)})
    assert str(draft) in str(info.value) and "different tokenizer" in str(info.value)
    wide = testing.tiny_model_dir(tmp_path / "c", vocab_size=64)
    with pytest.raises(ModelLoadError, match="64 output tokens, more than the target"):
        LLM(model=str(testing.tiny_model_dir(tmp_path / "d", vocab_size=32)),
            speculative_config={"decoding_type": "draft_target", "speculative_model": str(wide)})


def test_draft_layers_must_be_fewer_than_the_target(pair):
    with pytest.raises(ModelLoadError, match="not fewer than"):
        LLM(model=str(pair[0]), speculative_config={"decoding_type": "draft_target", "draft_layers": 2})


def test_sampling_follows_target_distribution_through_core_sampler(pair):
    """The 2nd token is verified against drafts sampled with their probabilities."""
    target, draft = pair
    _, accepted = testing.check_sampling_lossless({"decoding_type": "draft_target", "speculative_model": str(draft),
                                                   "max_draft_len": 2, "adaptive": False}, target,
                                                  prompt=[3, 4, 5, 6, 7])
    assert accepted > 0


def test_shipped_draft_is_the_default_on_the_embedded_model_lossless_and_accepted():
    """The trained draft shipped for SmolLM2: identical greedy output, many drafts accepted."""
    from specdec_draft_target import SHIPPED_DRAFT

    prompts = [[{"role": "user", "content": "Explain why the sky looks blue, in two sentences."}],
               [{"role": "user", "content": "A box holds 12 eggs. How many eggs are in 7 boxes? Think step by step."}]]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    plain = embedded.embedded_llm().chat(prompts, params)
    spec = LLM(speculative_config={"decoding_type": "draft_target", "max_draft_len": 3,
                                                    "adaptive": False})
    assert spec.drafter.draft_vocab is not None and (SHIPPED_DRAFT / "config.json").exists()
    got = spec.chat(prompts, params)
    for a, b in zip(plain, got):
        assert b.token_ids == a.token_ids
    accepted = sum(o.metrics.num_accepted_tokens for o in got)
    steps = sum(o.metrics.num_steps for o in got)
    # an untrained layer-skip draft accepts ~3% of first draft tokens; the trained one far more
    assert accepted > 0.3 * steps, (accepted, steps)


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with the shipped draft model's chains, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "draft_target"})
