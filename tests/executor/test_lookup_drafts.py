"""A method with a lookup drafter (``speculative_config.lookup``): the lookup drafts where
the text repeats what was seen, the method elsewhere, and the output stays the target's."""

import pytest
from helpers import count_accepted_by_source
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, testing


@pytest.fixture
def accepted_by_source(monkeypatch):
    return count_accepted_by_source(monkeypatch)


def test_greedy_output_is_plain_with_drafts_of_the_lookup_and_of_the_method_accepted(accepted_by_source):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    chats = [[{"role": "user", "content": turn}] for turn in embedded.AGENT_TURNS]
    want = [o.token_ids for o in embedded.embedded_llm().chat(chats, params)]
    spec = LLM(speculative_config={"decoding_type": "eagle3", "adaptive": False,
                                   "lookup": {"decoding_type": "suffix"}})
    alone = [spec.chat(chat, params)[0] for chat in chats]  # one after another: the suffix cache warms
    assert [o.token_ids for o in alone] == want
    assert accepted_by_source["lookup"] > 0 and accepted_by_source["method"] > 0, accepted_by_source
    batched = spec.chat(chats + chats, params)
    assert [o.token_ids for o in batched] == want + want


def test_sampled_output_follows_the_targets_distribution_with_both_drafting(tmp_path, accepted_by_source):
    """A draft model's drafts (drawn from its own distribution) where the suffix lookup has
    nothing, the lookup's (no distribution: one-hot) where it matched the prompt's repeats."""
    target = testing.tiny_model_dir(tmp_path / "target", vocab_size=32)
    draft = testing.tiny_model_dir(tmp_path / "draft", vocab_size=32, seed=1)
    _, accepted = testing.check_sampling_lossless(  # asserts the p-value
        {"decoding_type": "draft_target", "speculative_model": str(draft), "max_draft_len": 2,
         "lookup": {"decoding_type": "suffix", "max_draft_len": 2, "max_spec_factor": 2.0}},
        target, prompt=[3, 4, 5, 6, 3, 4, 5, 6, 3, 4])
    assert accepted > 0 and accepted_by_source["lookup"] > 0 and accepted_by_source["method"] > 0, accepted_by_source
