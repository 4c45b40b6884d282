"""Prefix caching under speculation: a multi-turn conversation, each turn the previous
turns and their answers plus a new question, finds as many prompt tokens in the prefix
cache with every drafting method as with plain decoding (drafts, hidden states and draft
KV must not cost cached blocks)."""

import pytest

from specdec import LLM, SamplingParams

QUESTIONS = ["Name three primary colors.", "Which of them is the warmest?", "Write a sentence using it.",
             "Now repeat that sentence twice.", "Shorten it to five words."]


def conversation_hits(llm: LLM) -> tuple[list[str], int, int]:
    """The answers of a five-turn chat, and the prompt tokens queried and found in the cache."""
    params = SamplingParams(max_tokens=40, temperature=0.0)
    messages, answers = [], []
    for question in QUESTIONS:
        messages.append({"role": "user", "content": question})
        answer = llm.chat(messages, params)[0].text
        messages.append({"role": "assistant", "content": answer})
        answers.append(answer)
    kv = llm.engine.kv
    return answers, kv.prefix_queried_tokens, kv.prefix_hit_tokens


@pytest.fixture(scope="module")
def plain_hits():
    return conversation_hits(LLM())


@pytest.mark.parametrize("method", ["ngram", "lookahead", "draft_target", "medusa", "eagle", "eagle3", "mtp",
                                    "redrafter"])
def test_every_method_hits_the_prefix_cache_as_plain_decoding_does(plain_hits, method):
    answers, queried, hits = plain_hits
    assert hits > queried / 2  # the earlier turns are found
    spec = LLM(speculative_config={"decoding_type": method, "adaptive": False})
    spec_answers, spec_queried, spec_hits = conversation_hits(spec)
    assert spec_answers == answers
    assert spec.engine.totals.num_accepted_tokens > 0
    assert (spec_queried, spec_hits) == (queried, hits)
