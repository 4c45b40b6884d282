"""Expansions pick from draft logits over a reduced vocabulary and propose target token ids."""

import types

import torch

from specdec import SamplingParams
from specdec.drafting.chain_stop import ChainStop
from specdec.drafting.tree import StaticTree
from specdec.drafting.tree_expansion import ChainExpansion, DynamicExpansion, StaticExpansion

#: draft column -> target id: a reduced vocabulary of 4 tokens out of 10, not in id order
VOCAB = torch.tensor([7, 2, 9, 4])
TARGET_VOCAB = 10


def request(params: SamplingParams, seed: int = 0):
    return types.SimpleNamespace(sampling_params=params, generator=torch.Generator().manual_seed(seed))


def test_a_greedy_chain_proposes_the_target_id_of_the_best_column():
    chain = ChainExpansion(2, request(SamplingParams(temperature=0.0)), TARGET_VOCAB, VOCAB)
    assert chain.grow([-1], torch.tensor([[0.1, 0.2, 3.0, 0.4]])) == [0]
    assert chain.grow([0], torch.tensor([[0.1, 2.0, 0.3, 0.4]])) == []
    proposal = chain.proposal()
    assert proposal.token_ids == [9, 2] and proposal.parents == [-1, 0] and proposal.draft_probs is None


def test_a_sampled_chain_keeps_its_distribution_over_the_target_vocabulary():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    chain = ChainExpansion(1, request(SamplingParams(temperature=1.0, top_p=1.0), seed=3), TARGET_VOCAB, VOCAB)
    chain.grow([-1], logits)
    proposal = chain.proposal()
    q = proposal.draft_probs[0]
    assert q.shape == (TARGET_VOCAB,) and torch.allclose(q[VOCAB], torch.softmax(logits[0], -1))
    outside = torch.ones(TARGET_VOCAB, dtype=torch.bool)
    outside[VOCAB] = False
    assert q[outside].eq(0).all()  # nothing outside the draft vocabulary
    assert proposal.token_ids[0] in VOCAB.tolist()


def test_a_static_tree_takes_each_rank_from_the_draft_columns():
    tree = StaticTree.from_choices([[0], [1], [0, 0]])
    expansion = StaticExpansion(tree, VOCAB)
    ranked = torch.tensor([[0.1, 0.9, 0.5, 0.0]])  # ranks: column 1 (id 2), column 2 (id 9)
    frontier = expansion.grow([-1], ranked)
    assert [expansion.token(n) for n in range(2)] == [2, 9]
    expansion.grow(frontier, torch.tensor([[0.0, 0.0, 0.0, 1.0]]))
    assert expansion.proposal().token_ids == [2, 9, 4]


def test_a_dynamic_tree_scores_draft_columns_and_proposes_target_ids():
    expansion = DynamicExpansion(top_k=2, depth=2, budget=3, vocab=VOCAB)
    frontier = expansion.grow([-1], torch.log(torch.tensor([[0.6, 0.3, 0.05, 0.05]])))
    assert sorted(expansion.token(n) for n in frontier) == [2, 7]
    expansion.grow(frontier, torch.log(torch.tensor([[0.1, 0.1, 0.1, 0.7], [0.9, 0.05, 0.03, 0.02]])))
    proposal = expansion.proposal()
    # the three best: 7 (.6), 2 (.3), 7 -> 4 (.42)
    assert sorted(zip(proposal.token_ids, proposal.parents)) == [(2, -1), (4, 0), (7, -1)]


def test_a_chain_stops_growing_once_its_draft_probability_falls_below_the_floor():
    """A greedy chain counts each argmax's probability: 0.9 grows, then 0.9 * 0.5 falls
    below 0.5 and stops, the token that crossed the floor still proposed."""
    likely = torch.log(torch.tensor([[0.05, 0.9, 0.03, 0.02]]))
    even = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.1]]))
    chain = ChainExpansion(3, request(SamplingParams(temperature=0.0)), TARGET_VOCAB, VOCAB, ChainStop(0.5))
    assert chain.grow([-1], likely) == [0]
    assert chain.grow([0], even) == []
    assert chain.proposal().token_ids == [2, 7]
    unbounded = ChainExpansion(3, request(SamplingParams(temperature=0.0)), TARGET_VOCAB, VOCAB)
    assert unbounded.grow([-1], even) == [0] and unbounded.grow([0], even) == [1]


def test_a_sampled_chain_stops_on_the_probability_of_the_token_it_drew():
    """The drawn token's own probability counts, not the likeliest's: a draw of the 0.2
    token stops a chain whose floor is 0.3; a draw of the 0.8 one does not."""
    logits = torch.log(torch.tensor([[0.8, 0.2, 0.0, 0.0]]))
    seen = set()
    for seed in range(40):
        chain = ChainExpansion(2, request(SamplingParams(temperature=1.0, top_p=1.0), seed), TARGET_VOCAB, VOCAB,
                               ChainStop(0.3))
        grows = chain.grow([-1], logits) == [0]
        token = chain.proposal().token_ids[0]
        assert grows == (token == 7), (token, grows)
        seen.add(token)
    assert seen == {7, 2}
