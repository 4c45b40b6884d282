"""A seed reproduces a sampled answer whatever drafted it and whatever it was batched with.

The seeded rule draws the token at each position with a number that depends on the seed and
the position alone (:func:`specdec.sampler.verify_seeded`), so a request's output is the one
plain sampling gives with its seed: with prompt lookup or EAGLE-3 drafting, alone or among
other requests whose drafts and depths differ. Rejection sampling's draws depended on how
many drafts each step verified (a crowd changed 9 of 40 ngram answers)."""

import pytest

from specdec import LLM, SamplingParams

PROMPTS = ["Repeat this list twice: apple, pear, plum, fig, kiwi, lime, date.",
           "Write the numbers from one to twenty in words, separated by commas.",
           "Copy this sentence three times: the cat sat on the mat by the door."]
OTHERS = ["Tell me a short story about a fox.", "List five colours and a fruit of each colour."]


@pytest.fixture(scope="module")
def plain():
    return LLM(engine={"compile": False})  # the default target: w4a8, batch-invariant


def answers(llm, prompts, params_for):
    return [o.token_ids for o in llm.chat([[{"role": "user", "content": p}] for p in prompts],
                                          [params_for(i) for i in range(len(prompts))])]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_seeded_answer_is_plain_samplings_alone_and_in_a_crowd(plain, method):
    def params(i, seed=None):
        return SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, seed=seed, ignore_eos=True)

    seeded = [lambda i, s=s: params(i, seed=100 + s) for s in range(len(PROMPTS))]
    expected = [answers(plain, [p], seeded[k])[0] for k, p in enumerate(PROMPTS)]
    llm = LLM(engine={"compile": False}, speculative_config={"decoding_type": method, "adaptive": False})
    alone = [llm.chat([{"role": "user", "content": p}], seeded[k](0))[0] for k, p in enumerate(PROMPTS)]
    assert [o.token_ids for o in alone] == expected
    assert sum(o.metrics.num_accepted_tokens for o in alone) > 0  # drafts were accepted
    # in a crowd: unseeded requests of other lengths beside them, the seeded ones twice
    crowd = PROMPTS + OTHERS + PROMPTS
    outs = llm.chat([[{"role": "user", "content": p}] for p in crowd],
                    [seeded[PROMPTS.index(p)](0) if p in PROMPTS else params(k) for k, p in enumerate(crowd)])
    assert [o.token_ids for o, p in zip(outs, crowd) if p in PROMPTS] == expected * 2
    assert len({tuple(e) for e in expected}) == len(expected)
