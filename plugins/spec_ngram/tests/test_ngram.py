"""spec_ngram: the pool, greedy losslessness on the embedded model, sampling through the core sampler."""

import pytest
from specdec_ngram import COPY_AGREEMENT, NGramConfig, NGramPool
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, testing

TEXT = ("The Apollo program was the third United States human spaceflight program carried out by NASA, "
        "which accomplished landing the first humans on the Moon from 1969 to 1972. It was first conceived "
        "during Dwight D. Eisenhower's administration as a three-person spacecraft to follow the one-person "
        "Project Mercury, which put the first Americans in space.")


def pool(**options):
    return NGramPool(NGramConfig(decoding_type="ngram", **options))


def test_longest_suffix_match_wins():
    p = pool(max_matching_ngram_size=3)
    seq = [1, 2, 3, 4, 9, 3, 4, 5, 6, 2, 3, 4]
    p.index(seq, 0, len(seq))
    assert p.lookup(seq, 2) == ([9, 3], 3)  # "2 3 4" -> 9 (not "3 4" -> 5)
    assert p.lookup([7, 3, 4], 3) == ([9, 3, 4], 2)  # "3 4": the oldest place


def test_newest_place_and_keep_only_the_newest():
    seq = [3, 4, 9, 8, 3, 4, 5, 6, 3, 4]
    newest = pool(is_use_oldest=False)
    newest.index(seq, 0, len(seq))
    assert newest.lookup(seq, 2) == ([5, 6], 2)
    single = pool(is_keep_all=False, is_use_oldest=True)
    single.index(seq, 0, len(seq))
    assert len(single.places[(3, 4)]) == 1 and single.lookup(seq, 2) == ([5, 6], 2)


def test_min_match_length_and_no_match():
    p = pool(max_matching_ngram_size=3, min_matching_ngram_size=2)
    seq = [1, 2, 3, 5]
    p.index(seq, 0, len(seq))
    assert p.lookup(seq + [3], 2) == ([], 0)  # only a 1-gram would match
    assert p.lookup([9, 9, 9], 2) == ([], 0)


def test_pool_is_updated_incrementally_and_continuations_grow():
    p = pool()
    seq = [1, 2, 3, 1, 2]
    p.index(seq, 0, 5)
    before = sum(len(v) for v in p.places.values())
    seq.extend([3, 7])
    p.index(seq, 5, 7)
    assert sum(len(v) for v in p.places.values()) > before
    assert p.lookup([1, 2], 4) == ([3, 1, 2, 3], 2)


def test_pool_keeps_at_most_max_pool_ngrams_and_evicts_the_least_recently_seen():
    p = pool(max_matching_ngram_size=2, min_matching_ngram_size=1, max_pool_ngrams=6)
    old = [1, 2, 3, 4]
    p.index(old, 0, len(old))  # 1-grams (1,) (2,) (3,) and 2-grams (1, 2) (2, 3)
    assert len(p.places) == 5
    p.index([1, 2, 9], 0, 3)  # sees (1,) (1, 2) again; adds (2,)->9 under a known key only
    new = [7, 8, 7, 8]
    p.index(new, 0, len(new))  # (7,) (8,) (7, 8) (8, 7): the pool overflows
    assert len(p.places) == 6
    assert (2, 3) not in p.places and (3,) not in p.places  # least recently seen went first
    assert p.lookup([5, 1, 2], 1) == ([3], 2)  # recently seen ones stay
    assert p.lookup([0, 7, 8], 2) == ([7, 8], 2)


def test_the_place_agreeing_longest_is_drafted_from_and_a_copy_is_a_kind_of_its_own():
    p = pool(max_matching_ngram_size=3)
    older = [11, 12, 13, 14, 15, 16, 17, 3, 4, 5, 90, 91]
    newer = [1, 2, 3, 4, 5, 80, 81]
    p.index(older, 0, len(older))
    p.index(newer, 0, len(newer))
    # "3 4 5" is at both places; five tokens agree with the newer one, only those three with the older
    assert p.lookup([7, 1, 2, 3, 4, 5], 2) == ([80, 81], 3)
    # ten tokens agree with the older one: a copy (COPY_AGREEMENT and more)
    assert p.lookup([0, 12, 13, 14, 15, 16, 17, 3, 4, 5], 2) == ([90, 91], COPY_AGREEMENT)
    # agreeing equally (only the n-gram), the oldest place, as before
    assert p.lookup([9, 3, 4, 5], 1) == ([90], 3)


def test_proposals_carry_their_match_length_as_kind():
    from types import SimpleNamespace

    from specdec_ngram import NGramDrafter

    drafter = NGramDrafter(NGramConfig(decoding_type="ngram", max_matching_ngram_size=3), target=None)
    one = SimpleNamespace(drafter_state={}, token_ids=[4, 5, 6, 7, 8, 9, 1, 7])
    (proposal,) = drafter.prepare_draft_tokens([one], [3])
    assert proposal.kind == 1 and proposal.token_ids == [8, 9, 1]  # only "7" matches
    three = SimpleNamespace(drafter_state={}, token_ids=[2, 5, 6, 7])
    (proposal,) = drafter.prepare_draft_tokens([three], [2])
    assert proposal.kind == 3 and proposal.token_ids == [8, 9]  # "5 6 7" in the public pool


def test_public_pool_shares_across_requests(tmp_path):
    model = testing.tiny_model_dir(tmp_path)
    prompt_a = [5, 6, 7, 8, 9, 10, 11, 12]
    # adaptive off: the planner follows measured step times (under load it may not draft); this is about the pool
    shared = LLM(model=str(model), dtype="float32",
                 speculative_config={"decoding_type": "ngram", "is_public_pool": True, "adaptive": False})
    private = LLM(model=str(model), dtype="float32",
                  speculative_config={"decoding_type": "ngram", "is_public_pool": False, "adaptive": False})
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for llm in (shared, private):
        llm.generate([prompt_a], params)
    # a request that has never seen [7, 8, ...] itself only gets drafts from the public pool
    b_shared = shared.generate([[1, 7, 8]], params)[0]
    b_private = private.generate([[1, 7, 8]], params)[0]
    assert b_shared.metrics.num_draft_tokens > 0
    assert b_private.metrics.drafted_at[:1] != b_shared.metrics.drafted_at[:1]


def test_conformance():
    testing.check_registration("ngram", distribution="specdec-plugin-ngram")
    testing.check_config_round_trip({"decoding_type": "ngram", "max_draft_len": 6, "max_matching_ngram_size": 4,
                                     "is_public_pool": False, "is_keep_all": False, "is_use_oldest": False})


@pytest.fixture(scope="module")
def plain():
    return embedded.embedded_llm()


@pytest.mark.parametrize("options", [{"max_draft_len": 4}, {"max_draft_len": 8, "max_matching_ngram_size": 5},
                                     {"max_draft_len": 3, "is_public_pool": False, "is_use_oldest": False}])
def test_greedy_lossless_on_embedded_model(plain, options):
    prompts = [[{"role": "user", "content": "Summarize in one sentence:\n\n" + TEXT}],
               [{"role": "user", "content": "Fix the bug:\n\ndef add(a, b):\n    return a - b\n"}]]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    want = plain.chat(prompts, params)
    spec = LLM(speculative_config={"decoding_type": "ngram", "adaptive": False, **options})
    got = spec.chat(prompts, params)
    for a, b in zip(want, got):
        assert b.token_ids == a.token_ids
    assert sum(o.metrics.num_accepted_tokens for o in got) > 0
    assert sum(o.metrics.num_steps for o in got) < sum(o.metrics.num_steps for o in want)


def test_sampling_follows_target_distribution_through_core_sampler(tmp_path):
    """A prompt ending in a repeated pattern, so ngram drafts the token being verified."""
    _, accepted = testing.check_sampling_lossless({"decoding_type": "ngram", "max_draft_len": 2},
                                                  testing.tiny_model_dir(tmp_path, vocab_size=32),
                                                  prompt=[3, 4, 5, 6, 3, 4, 5, 6, 3, 4])
    assert accepted > 0


def test_structured_output_is_the_constrained_targets():
    """JSON-schema output with n-gram drafts from the prompt and the JSON so far, drafts the grammar forbids pruned."""
    embedded.check_structured_lossless({"decoding_type": "ngram"})
