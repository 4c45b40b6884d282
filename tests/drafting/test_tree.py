"""Core tree utilities: choice lists in both notations, EAGLE-2 expansion and rerank, tries."""

import math

import pytest
import torch

from specdec import DraftProposal
from specdec.drafting.tree import DynamicTree, StaticTree, ancestor_mask, default_tree_mask, prefix_trie


def test_candidates_merge_into_a_trie():
    tokens, parents = prefix_trie([(5, 6, 7), (5, 6, 8), (9, 1, 2)], depth=3)
    assert tokens == [5, 6, 7, 8, 9, 1, 2] and parents == [-1, 0, 1, 1, -1, 4, 5]
    assert prefix_trie([(5, 6, 7)], depth=2) == ([5, 6], [-1, 0])


def test_choice_lists_in_both_notations_give_one_tree():
    all_nodes = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    unique_paths = [[0, 0, 0], [0, 1], [1, 0]]
    a, b = StaticTree.from_choices(all_nodes), StaticTree.from_choices(unique_paths)
    assert a == b
    assert a.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))
    assert a.parents == (-1, -1, 0, 0, 1, 2)
    assert (a.depth, a.num_nodes, a.max_rank, a.level(2)) == (3, 6, 1, [2, 3, 4])
    # the seed documents' example, unique paths only
    seed = StaticTree.from_choices([[0, 0, 0, 0], [0, 1, 0], [1, 0], [1, 1]])
    assert seed.num_nodes == 9 and seed.depth == 4


def test_static_tree_fill_and_cached_mask():
    tree = StaticTree.from_choices([[0, 0], [0, 1], [1]])
    # candidates best first, below the root and below each node
    ranked = [[10, 11], [20, 21], [30, 31], [40, 41], [50, 51]]
    assert tree.fill(ranked) == [10, 11, 20, 21]
    assert tree.mask() is tree.mask()  # built once
    assert torch.equal(tree.mask(), ancestor_mask(list(tree.parents)))
    prop = DraftProposal(token_ids=tree.fill(ranked), parents=list(tree.parents))
    assert default_tree_mask(prop).mask is tree.mask()


def test_a_static_tree_asked_for_fewer_nodes_keeps_its_first_nodes_or_its_chain_of_first_children():
    """More nodes than levels: the tree's first nodes by depth. No more nodes than levels
    (the planner's chain): the path of first children, the chain whose acceptance the planner
    counts inside every verified tree (:func:`~specdec.drafting.interface.first_child_path`)."""
    tree = StaticTree.from_choices([[0], [0, 0], [0, 0, 0], [1], [0, 1], [2], [1, 0]])
    assert tree.trimmed(2, 4).paths == ((0,), (1,), (2,), (0, 0))
    assert tree.trimmed(3, 3).paths == ((0,), (0, 0), (0, 0, 0))
    assert tree.trimmed(3, 2).paths == ((0,), (0, 0))
    assert tree.trimmed(1, 1).paths == ((0,),)
    assert StaticTree.from_choices([[1, 2], [1, 3]]).trimmed(2, 2).paths == ((1,), (1, 2))
    # a tree shallower than the depth asked for: as many nodes as levels asked is still the tree
    assert StaticTree.from_choices([[0], [1]]).trimmed(3, 3).paths == ((0,), (1,))


@pytest.mark.parametrize("bad", [[[]], [[0, -1]], [["a"]], [[True]], "x", []])
def test_bad_choice_lists_are_named(bad):
    with pytest.raises(ValueError):
        StaticTree.from_choices(bad)


def test_dynamic_tree_expands_best_frontier_and_reranks_to_a_budget():
    vocab = 6
    tree = DynamicTree(top_k=2)
    root = torch.log(torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.03, 0.02]]))
    first = tree.expand(root)
    assert [tree.tokens[n] for n in first] == [0, 1] and tree.frontier == first
    below = torch.log(torch.tensor([[0.9, 0.1, 0, 0, 0, 0], [0.2, 0.2, 0.6, 0, 0, 0]]) + 1e-9)
    second = tree.expand(below)
    # children: under 0 -> (0: .45, 1: .05); under 1 -> (2: .18, 0 or 1: .06)
    scores = {n: math.exp(tree.scores[n]) for n in second}
    assert sorted(round(v, 2) for v in scores.values()) == [0.05, 0.06, 0.18, 0.45]
    assert sorted(tree.tokens[n] for n in tree.frontier) == [0, 2]  # the two best children
    tokens, parents, nodes = tree.rerank(4)
    # best four overall: 0 (.5), 0->0 (.45), 1 (.3), 1->2 (.18)
    assert sorted(zip(tokens, [tokens[p] if p >= 0 else -1 for p in parents])) == \
        sorted([(0, -1), (1, -1), (0, 0), (2, 1)])
    assert all(p < i for i, p in enumerate(parents))
    assert len(tree.rerank(100)[0]) == len(tree.tokens) and vocab == 6


def test_proposal_subset_keeps_a_tree():
    prop = DraftProposal(token_ids=[1, 2, 3, 4], parents=[-1, 0, -1, 2], draft_probs=torch.eye(4))
    sub = prop.subset([0, 2, 3])
    assert sub.token_ids == [1, 3, 4] and sub.parents == [-1, -1, 1]
    assert torch.equal(sub.draft_probs, torch.eye(4)[[0, 2, 3]])
