"""MTP's relaxed acceptance (opt-in, lossy): the top-k and delta boundaries by hand, the
thinking delimiters read from the tokenizer, and a request that used it is labelled
lossy in its metrics."""

import math

import pytest
import torch

from specdec import LLM, DraftProposal, SamplingParams
from specdec.config_loading import config_from_dict
from specdec.model.loading import load_tokenizer, resolve_model_dir

PROBS = [0.4, 0.3, 0.2, 0.1]


class _Req:
    def __init__(self, token_ids=()):
        self.sampling_params = SamplingParams(temperature=0.0)
        self.token_ids = list(token_ids)
        self.generator = torch.Generator().manual_seed(0)


def _rule(**options):
    spec = config_from_dict({"speculative_config": {"decoding_type": "mtp", "use_relaxed_acceptance_for_thinking": True,
                                                    **options}}).speculative_config
    return spec.acceptance_rule()


def _accepted(rule, draft_token):
    logits = torch.log(torch.tensor([PROBS, PROBS]))
    verdict = rule.verify(logits.softmax(-1), logits, DraftProposal(token_ids=[draft_token]), _Req())
    return verdict.accepted_nodes == [0]


@pytest.mark.parametrize("topk, delta, token, accepted", [
    (1, 0.0, 0, True),  # the argmax: always
    (2, 0.1001, 1, True),  # 0.3 >= 0.4 - 0.1001
    (2, 0.0999, 1, False),  # 0.3 < 0.4 - 0.0999: delta decides
    (2, 0.5, 2, False),  # within delta but rank 3 of top-2: top-k decides
    (3, 0.2001, 2, True),
    (3, 0.1999, 2, False),
])
def test_topk_and_delta_boundaries(topk, delta, token, accepted):
    assert _accepted(_rule(relaxed_topk=topk, relaxed_delta=delta), token) is accepted


def test_thinking_delimiters_come_from_the_tokenizer_unless_given():
    tokenizer = load_tokenizer(resolve_model_dir(None))
    spec = config_from_dict({"speculative_config": {"decoding_type": "mtp", "use_relaxed_acceptance_for_thinking": True,
                                                    "relaxed_topk": 2, "relaxed_delta": 0.2}}).speculative_config
    assert spec.acceptance_rule(tokenizer).begin_token is None  # SmolLM2 has no thinking tokens: always on
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    begin, end = tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    rule = spec.acceptance_rule(tokenizer)
    assert (rule.begin_token, rule.end_token) == (begin, end)
    assert rule.in_thinking([5, begin, 9]) and not rule.in_thinking([5, begin, 9, end, 4]) and not rule.in_thinking([5])
    logits = torch.log(torch.tensor([PROBS, PROBS]))
    inside = rule.verify(logits.softmax(-1), logits, DraftProposal(token_ids=[1]), _Req([begin, 7]))
    assert inside.accepted_nodes == [0] and inside.tokens == [1, 0]
    assert rule.verify(logits.softmax(-1), logits, DraftProposal(token_ids=[1]), _Req([begin, 7, end])) is None
    explicit = config_from_dict({"speculative_config": {
        "decoding_type": "mtp", "use_relaxed_acceptance_for_thinking": True, "begin_thinking_phase_token": 3,
        "end_thinking_phase_token": 4}}).speculative_config.acceptance_rule(tokenizer)
    assert (explicit.begin_token, explicit.end_token) == (3, 4)
    assert math.isclose(rule.delta, 0.2)


def test_requests_under_relaxed_acceptance_are_labelled_lossy():
    prompts = [[{"role": "user", "content": "Write a haiku about rivers."}]]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    exact = LLM(dtype="float32", speculative_config={"decoding_type": "mtp", "adaptive": False}).chat(prompts, params)
    relaxed = LLM(dtype="float32", speculative_config={"decoding_type": "mtp", "adaptive": False,
                                                       "use_relaxed_acceptance_for_thinking": True,
                                                       "relaxed_topk": 4, "relaxed_delta": 0.5}).chat(prompts, params)
    assert exact[0].metrics.lossless and not relaxed[0].metrics.lossless
    assert relaxed[0].metrics.num_accepted_tokens >= exact[0].metrics.num_accepted_tokens
