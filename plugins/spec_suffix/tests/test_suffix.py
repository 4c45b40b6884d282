"""spec_suffix: the counted trie, the shared cache's bound, drafting trees, losslessness on
the embedded model (alone, batched, with the cache warm), sampling through the core sampler."""

import gc
import random
from types import SimpleNamespace

import pytest
from specdec_suffix import SuffixCache, SuffixConfig, SuffixDrafter
from specdec_suffix.trie import WIDE, SuffixTrie
from specdec_test_support import embedded

from specdec import LLM, SamplingParams, testing


def config(**options):
    return SuffixConfig(decoding_type="suffix", **options)


def counts(trie, node=None, prefix=()):
    """Every counted substring of ``trie`` with its count."""
    node = trie.root if node is None else node
    out = {}
    for child in trie.children(node):
        out[prefix + (trie.token[child],)] = trie.count[child]
        out.update(counts(trie, child, prefix + (trie.token[child],)))
    return out


def brute_counts(sequences, depth):
    out = {}
    for seq in sequences:
        for i in range(len(seq)):
            for n in range(1, depth + 1):
                if i + n <= len(seq):
                    key = tuple(seq[i:i + n])
                    out[key] = out.get(key, 0) + 1
    return out


def test_the_trie_counts_every_substring_up_to_its_depth_added_at_once_or_token_by_token():
    a, b = [1, 2, 3, 1, 2, 4, 1, 2, 3], [2, 3, 5, 2, 3]
    whole, stepwise = SuffixTrie(4), SuffixTrie(4)
    whole.add(a)
    whole.add(b)
    for seq in (a, b):
        open_nodes = []
        for token in seq:
            open_nodes = stepwise.extend(open_nodes, [token])
    assert counts(whole) == counts(stepwise) == brute_counts([a, b], 4)
    assert whole.nodes == len(counts(whole)) + 1
    whole.remove(a)
    assert counts(whole) == brute_counts([b], 4) and whole.nodes == len(counts(whole)) + 1
    whole.remove(b)
    assert whole.children(whole.root) == [] and whole.nodes == 1


def test_wide_nodes_and_freed_nodes_keep_the_counts_exact():
    """Nodes of more children than WIDE are indexed, and unindexed as they lose them; freed
    nodes are reused: the counts stay every substring's after adds and removes in any order."""
    rng = random.Random(1)
    seqs = [[rng.randrange(30) for _ in range(rng.randint(5, 60))] for _ in range(40)]
    trie = SuffixTrie(5)
    for seq in seqs:
        trie.add(seq)
    assert any(len(trie.children(n)) > WIDE for n in trie.wide) and counts(trie) == brute_counts(seqs, 5)
    for seq in seqs[::2]:
        trie.remove(seq)
    assert counts(trie) == brute_counts(seqs[1::2], 5) and trie.nodes == len(counts(trie)) + 1
    for seq in seqs[::2]:  # the freed nodes come back
        trie.add(seq)
    assert counts(trie) == brute_counts(seqs, 5) and len(trie.token) < 2 * trie.nodes
    for seq in seqs:
        trie.remove(seq)
    assert trie.nodes == 1 and not trie.wide and trie.children(trie.root) == []


def test_the_trie_gives_the_garbage_collector_nothing_per_node():
    """A full cache holds millions of nodes: as objects, every full collection walked them all."""
    rng = random.Random(2)
    words = [rng.randrange(49152) for _ in range(500)]
    gc.collect()
    before = len(gc.get_objects())
    trie = SuffixTrie(24)
    for _ in range(20):
        trie.add([rng.choice(words) for _ in range(200)])
    assert trie.nodes > 50_000 and len(gc.get_objects()) - before < 50


def test_the_longest_known_suffix_is_matched():
    trie = SuffixTrie(8)
    trie.add([7, 1, 2, 3, 4, 9])
    node, length = trie.match([5, 5, 1, 2, 3], longest=6)
    assert length == 3 and [trie.token[c] for c in trie.children(node)] == [4]
    assert trie.match([8, 8], longest=6) == (None, 0)
    assert trie.match([7, 1, 2, 3], longest=2)[1] == 2  # capped


def test_the_draft_tree_is_best_first_with_frequencies_and_a_floor():
    trie = SuffixTrie(6)
    for tail in ([10, 11], [10, 11], [10, 12], [20, 21]):
        trie.add([1, 2] + tail)
    node, _ = trie.match([0, 1, 2], longest=4)
    tokens, parents, scores = trie.draft(node, max_nodes=10, max_depth=3, min_prob=0.2)
    # "1 2" was followed by 10 three times in four, 20 once; 10 by 11 twice in three
    assert tokens == [10, 11, 20, 21, 12] and parents == [-1, 0, -1, 2, 0]  # ties: the latest seen first
    assert scores == pytest.approx([0.75, 0.5, 0.25, 0.25, 0.25])
    assert trie.draft(node, max_nodes=10, max_depth=3, min_prob=0.3)[0] == [10, 11]
    assert trie.draft(node, max_nodes=2, max_depth=1, min_prob=0.0)[0] == [10, 20]


def test_equally_frequent_continuations_are_drafted_latest_first():
    trie = SuffixTrie(6)
    trie.add([1, 2, 30, 1, 2, 40, 1, 2, 35])
    node, _ = trie.match([1, 2], longest=4)
    assert trie.draft(node, max_nodes=3, max_depth=1, min_prob=0.0)[0] == [35, 40, 30]
    trie.add([1, 2, 30])  # 30 now seen twice: frequency first
    node, _ = trie.match([1, 2], longest=4)
    assert trie.draft(node, max_nodes=3, max_depth=1, min_prob=0.0)[0] == [30, 35, 40]


def test_the_cache_forgets_the_least_recent_requests_beyond_its_bounds():
    cache = SuffixCache(config(max_cached_requests=2, max_tree_depth=4))
    for seq in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        cache.add(seq)
    assert counts(cache.trie) == brute_counts([[4, 5, 6], [7, 8, 9]], 4)
    by_tokens = SuffixCache(config(max_cached_tokens=7, max_tree_depth=4))
    for seq in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        by_tokens.add(seq)
    assert by_tokens.tokens == 6 and counts(by_tokens.trie) == brute_counts([[4, 5, 6], [7, 8, 9]], 4)


def request(tokens, prompt_len, extra_args=None):
    return SimpleNamespace(drafter_state={}, token_ids=list(tokens), prompt_len=prompt_len,
                           sampling_params=SamplingParams(extra_args=extra_args))


def test_a_request_drafts_from_itself_and_from_finished_requests_unless_they_opted_out():
    drafter = SuffixDrafter(config(max_spec_factor=4.0), target=None)
    first = request([1, 2, 3, 4, 5, 6, 7, 8], prompt_len=3)
    assert drafter.prepare_draft_tokens([first], [8], [8]) == [None]  # nothing ever followed 8
    drafter.on_request_finished(first)  # its output 4..8 enters the cache
    second = request([9, 4, 5], prompt_len=3)
    (proposal,) = drafter.prepare_draft_tokens([second], [8], [8])
    assert proposal.token_ids == [6, 7, 8] and proposal.kind == 2
    # a tree holds no more nodes than the depth the planner chose (the chain it priced)
    assert drafter.prepare_draft_tokens([second], [2], [8])[0].token_ids == [6, 7]
    private = SuffixDrafter(config(), target=None)
    private.on_request_finished(request([1, 2, 3, 4, 5, 6], prompt_len=2, extra_args={"suffix_cache": False}))
    assert private.cache.tokens == 0 and private.cache.trie.nodes == 1


def test_the_source_rule_chooses_between_the_requests_own_draft_and_the_caches():
    """The cache holds "3 4 5 -> 6 7" three times (a score of 2.0); the requests' own text
    "-> 11 12" once after "3 4 5" (a three-token match) or after "4 5" (two), a score of 1.0."""
    long_match, short_match = [3, 4, 5, 11, 12, 3, 4, 5], [4, 5, 11, 12, 4, 5]
    for options, want_long, want_short in (({}, [11, 12], [6, 7]),
                                           ({"min_request_match": 2}, [11, 12], [11, 12]),
                                           ({"min_request_match": 4}, [6, 7], [6, 7]),
                                           ({"source": "best_score", "min_request_match": 1}, [6, 7], [6, 7])):
        drafter = SuffixDrafter(config(**options), target=None)
        for _ in range(3):
            drafter.on_request_finished(request([0, 3, 4, 5, 6, 7], prompt_len=1))
        for tokens, want in ((long_match, want_long), (short_match, want_short), ([9, 4, 5], [6, 7])):
            got = drafter.prepare_draft_tokens([request(tokens, prompt_len=len(tokens))], [2], [2])[0]
            assert got.token_ids == want, (options, tokens)


def test_a_match_that_occurred_only_where_a_longer_one_did_is_not_drafted_again():
    """A shorter suffix as frequent as the longer one before it has the same continuations
    and no more nodes: skipping its draft leaves every proposal as drafting each match gives."""
    rng = random.Random(0)
    phrases = [[rng.randrange(40) for _ in range(rng.randint(3, 9))] for _ in range(12)]
    text = [t for _ in range(60) for t in rng.choice(phrases) + [rng.randrange(40)]]  # repeats and noise
    for options in ({}, {"max_spec_factor": 2.0, "max_tree_depth": 10}, {"max_tree_depth": 6, "max_match_len": 5}):
        drafter = SuffixDrafter(config(**options), target=None)
        trie, open_nodes, skipped = SuffixTrie(drafter.config.max_tree_depth), [], 0
        drafted = []
        trie.draft = lambda *args, draft=trie.draft: drafted.append(args) or draft(*args)
        for i, token in enumerate(text):
            open_nodes = trie.extend(open_nodes, [token])
            for depth, nodes in ((16, 16), (3, 3), (6, 20)):
                drafted.clear()
                got = drafter._propose(trie, text[:i + 1], depth, nodes)
                _, longest = trie.match(text[:i + 1], drafter.config.max_match_len)
                every = None
                for matched in range(longest, 0, -1):
                    budget = min(nodes, depth, int(drafter.config.max_spec_factor * matched))
                    if budget <= 0:
                        break
                    tokens, parents, scores = SuffixTrie.draft(trie, trie.node_of(text[i + 1 - matched:i + 1]),
                                                               budget, depth, drafter.config.min_token_prob)
                    if tokens and (every is None or sum(scores) > every[0]):
                        every = (sum(scores), tokens, parents, matched)
                    skipped += 1
                skipped -= len(drafted)
                assert got == every, (options, i, depth)
        assert skipped > len(text)  # the rule saved drafts


def test_the_process_scope_shares_one_cache_between_drafters():
    a = SuffixDrafter(config(cache_scope="process"), target=None)
    b = SuffixDrafter(config(cache_scope="process"), target=None)
    assert a.cache is b.cache and SuffixDrafter(config(), target=None).cache is not a.cache


def test_conformance():
    testing.check_registration("suffix", distribution="specdec-plugin-suffix")
    testing.check_config_round_trip({"decoding_type": "suffix", "max_draft_len": 8, "max_spec_factor": 2.0,
                                     "max_cached_requests": 10, "cache_prompts": True, "cache_scope": "process",
                                     "source": "best_score", "min_request_match": 2})


@pytest.fixture(scope="module")
def plain():
    return embedded.embedded_llm()


def test_greedy_lossless_alone_batched_and_with_the_cache_warm(plain):
    params = SamplingParams(max_tokens=48, temperature=0.0)
    chats = [[{"role": "user", "content": t}] for t in embedded.AGENT_TURNS]
    want = [o.token_ids for o in plain.chat(chats, params)]
    spec = LLM(speculative_config={"decoding_type": "suffix", "adaptive": False})
    alone = [spec.chat(c, params)[0] for c in chats]  # each turn after the last: the cache warms
    assert [o.token_ids for o in alone] == want
    assert sum(o.metrics.num_accepted_tokens for o in alone[1:]) > 0
    batched = spec.chat(chats + chats, params)  # the cache warm, the turns side by side
    assert [o.token_ids for o in batched] == want + want
    assert sum(o.metrics.num_accepted_tokens for o in batched) > sum(o.metrics.num_accepted_tokens for o in alone)


def test_sampling_follows_target_distribution_through_core_sampler(tmp_path):
    """A prompt ending in a repeated pattern, so the request's own trie drafts."""
    _, accepted = testing.check_sampling_lossless({"decoding_type": "suffix", "max_draft_len": 2,
                                                   "max_spec_factor": 2.0},
                                                  testing.tiny_model_dir(tmp_path, vocab_size=32),
                                                  prompt=[3, 4, 5, 6, 3, 4, 5, 6, 3, 4])
    assert accepted > 0


def test_a_server_request_opts_out_with_extra_args():
    """The OpenAI body's ``extra_args`` (vLLM's field) reaches the request's SamplingParams."""
    from specdec.serving.openai_protocol import ChatRequest, sampling_params_of

    body = ChatRequest(model="any", messages=[{"role": "user", "content": "hi"}],
                       extra_args={"suffix_cache": False})
    assert sampling_params_of(body, SamplingParams()).extra_args == {"suffix_cache": False}
    plain = ChatRequest(model="any", messages=[{"role": "user", "content": "hi"}])
    assert sampling_params_of(plain, SamplingParams()).extra_args is None
