"""The adaptive draft planner: the step-cost model, acceptance estimates, the choice of
depths against synthetic cost curves, and the engine switching speculation off and back
on without changing greedy output."""

import collections
import itertools
import random
import time
import types

import pytest
import torch

from specdec import LLM, SamplingParams, hookimpl, testing
from specdec.drafting.interface import LOOKUP_KIND, DraftProposal
from specdec.executor.planner import (
    AcceptanceCalibration,
    AcceptanceSpread,
    AcceptanceStats,
    DraftOption,
    DraftPlanner,
    FixedCosts,
    RequestDraftState,
    StepCostModel,
    best_depths,
)


def chain(rate: float, depth: int) -> DraftOption:
    """A chain whose every position is accepted with ``rate`` once its parent was."""
    return DraftOption(gains=[rate ** j for j in range(1, depth + 1)], nodes=list(range(depth + 1)))


def brute_force(options, base_tokens, step_seconds, draft_seconds=lambda d: 0.0):
    best, best_rate = None, -1.0
    for depths in itertools.product(*(range(len(o.nodes)) for o in options)):
        tokens = base_tokens + sum(o.nodes[d] for o, d in zip(options, depths))
        expected = len(options) + sum(sum(o.gains[:d]) for o, d in zip(options, depths))
        deepest = max(depths)
        rate = expected / (step_seconds(tokens) + (draft_seconds(deepest) if deepest else 0.0))
        if rate > best_rate * 1.001:
            best, best_rate = list(depths), rate
    return best_rate, best


def rate_of(options, depths, base_tokens, step_seconds):
    tokens = base_tokens + sum(o.nodes[d] for o, d in zip(options, depths))
    return (len(options) + sum(sum(o.gains[:d]) for o, d in zip(options, depths))) / step_seconds(tokens)


def test_flat_cost_drafts_everything_useful_and_steep_cost_nothing():
    flat = lambda n, *_: 0.010 if n <= 64 else 0.010 * n / 64  # a GPU: verification free up to 64 tokens
    assert best_depths([chain(0.6, 8)], 1, flat) == [8]
    assert best_depths([chain(0.3, 8)], 1, flat) == [5]  # 0.3 ** 6 adds under 0.1%: not worth a token
    steep = lambda n, *_: 1.0 + 0.5 * n  # each token costs half a step
    assert best_depths([chain(0.3, 8)], 1, steep) == [0]
    assert best_depths([chain(0.95, 8)], 1, steep)[0] >= 6


def test_draft_cost_can_make_drafting_unprofitable():
    cpu = lambda n, *_: 0.035 + 0.0008 * n  # a step's cost on the embedded model: fixed plus per token
    assert best_depths([chain(0.5, 4)], 1, cpu) == [4]
    assert best_depths([chain(0.5, 4)], 1, cpu, lambda depth, tokens: 0.040 * depth) == [0]


def test_batch_choice_gives_drafts_to_the_requests_that_earn_them():
    cpu = lambda n, *_: 0.030 + 0.003 * n
    options = [chain(0.9, 6), chain(0.05, 6), chain(0.6, 6), chain(0.0, 6)]
    depths = best_depths(options, 4, cpu)
    assert depths[1] == 0 and depths[3] == 0
    assert depths[0] >= depths[2] > 0
    assert rate_of(options, depths, 4, cpu) == pytest.approx(brute_force(options, 4, cpu)[0], rel=1e-3)


def test_choice_matches_brute_force_on_random_batches():
    rng = random.Random(0)
    for _ in range(60):
        a, b = rng.uniform(0.01, 0.05), rng.uniform(0.0, 0.01)
        cost = lambda n, *_, a=a, b=b: a + b * n
        options = [chain(rng.random(), rng.randint(0, 4)) for _ in range(rng.randint(1, 4))]
        base = len(options) + rng.randint(0, 10)
        depths = best_depths(options, base, cost)
        assert rate_of(options, depths, base, cost) == pytest.approx(brute_force(options, base, cost)[0], rel=2e-3)


def test_the_search_stops_once_no_deeper_draft_can_pay_and_still_finds_the_best():
    """Costs only grow with the tokens verified: once the gains left cannot lift the rate
    over the best at today's cost, the search ends, with the brute force's answer."""
    rng = random.Random(1)
    stopped_early = 0
    for _ in range(80):
        a, b = rng.uniform(0.01, 0.05), rng.uniform(0.001, 0.01)
        calls = []
        cost = lambda n, *_, a=a, b=b, calls=calls: calls.append(n) or a + b * n
        options = [chain(rng.uniform(0.3, 0.9), rng.randint(2, 5)) for _ in range(rng.randint(2, 4))]
        base = len(options)
        depths = best_depths(options, base, cost)
        stopped_early += len(calls) < 1 + sum(len(o.nodes) - 1 for o in options)
        assert rate_of(options, depths, base, cost) == pytest.approx(brute_force(options, base, cost)[0], rel=2e-3)
    assert stopped_early > 40


def test_tree_nodes_count_against_the_step():
    cost = lambda n, *_: 1.0 + 0.2 * n
    tree = DraftOption(gains=[0.9, 0.8, 0.7], nodes=[0, 2, 6, 14])  # wider at every level
    narrow = DraftOption(gains=[0.9, 0.8, 0.7], nodes=[0, 1, 2, 3])
    assert best_depths([narrow], 1, cost) == [3]
    assert best_depths([tree], 1, cost) == [1]  # deeper levels cost more than they bring


def test_cost_model_recovers_a_step_cost_from_tokens_and_attention():
    costs = StepCostModel()
    assert costs.step_seconds(4) < costs.step_seconds(8)  # before any step: near free, increasing
    truth = lambda tokens, work: 0.030 + 0.0004 * tokens + 0.0002 * work
    rng = random.Random(1)
    for _ in range(200):
        tokens = rng.randint(1, 120)
        work = tokens * rng.randint(100, 3000) / 1000
        costs.observe_step(tokens, work, truth(tokens, work) * rng.uniform(0.97, 1.03))
    a, jump, b, c = costs.coefficients()
    assert a == pytest.approx(0.030, rel=0.1) and b == pytest.approx(0.0004, rel=0.3)
    assert c == pytest.approx(0.0002, rel=0.1) and jump == pytest.approx(0.0, abs=0.002)


def _fed_a_compiled_curve(costs: StepCostModel, one_token_steps: bool) -> StepCostModel:
    """A step of 27 ms for one token, 34 ms for two, then 1 ms per token: the shape of
    the embedded model's compiled step at its steepest."""
    rng = random.Random(2)
    for _ in range(150):
        tokens = 1 if one_token_steps and rng.random() < 0.4 else rng.randint(2, 17)
        costs.observe_step(tokens, 0.0, (0.026 + 0.006 * (tokens > 1) + 0.001 * tokens) * rng.uniform(0.98, 1.02))
    return costs


def test_cost_model_fits_the_jump_from_one_token_to_two():
    costs = _fed_a_compiled_curve(StepCostModel(), one_token_steps=True)
    a, jump, b, c = costs.coefficients()
    assert a == pytest.approx(0.026, rel=0.1) and jump == pytest.approx(0.006, rel=0.2)
    assert b == pytest.approx(0.001, rel=0.2) and c == 0.0
    assert costs.step_seconds(1) == pytest.approx(0.027, rel=0.03)
    assert costs.step_seconds(2) == pytest.approx(0.034, rel=0.03)
    # a first draft position accepted 15% of the time does not pay for the jump; 50% does
    options = lambda p: [DraftOption(gains=[p, p * p, p ** 3], nodes=[0, 1, 2, 3])]  # noqa: E731
    assert best_depths(options(0.15), 1, lambda tokens, *_: costs.step_seconds(tokens)) == [0]
    assert best_depths(options(0.5), 1, lambda tokens, *_: costs.step_seconds(tokens)) != [0]
    # the straight line through the same steps hides the jump and would draft at 15%
    linear = _fed_a_compiled_curve(StepCostModel(), one_token_steps=True)
    linear.MIN_STEPS_OF_EACH = float("inf")
    assert best_depths(options(0.15), 1, lambda tokens, *_: linear.step_seconds(tokens)) != [0]


def test_cost_model_fits_the_jump_when_one_sequence_of_a_batch_verifies_drafts():
    """A batch of eight whose step jumps by 15.5 ms once any sequence verifies drafts
    (the shape a one-token graph gives at batch 1), then costs 0.3 ms a token."""
    rng = random.Random(0)
    costs, line = StepCostModel(), StepCostModel()  # line: told only the step's tokens
    for _ in range(80):
        drafting = rng.choice([0, 0, 1, 1, 2, 8])
        tokens, widest = 8 + 2 * drafting, 3 if drafting else 1
        seconds = (0.0568 + 0.0155 * (widest > 1) + 0.0003 * tokens) * rng.uniform(0.98, 1.02)
        costs.observe_step(tokens, 0.0, seconds, widest)
        line.observe_step(tokens, 0.0, seconds, tokens)
    assert costs.coefficients()[1] == pytest.approx(0.0155, rel=0.2)
    # one request of eight, its two nodes accepted 35% of the time: not worth the jump...
    one = [DraftOption(gains=[0.35], nodes=[0, 2])] + [DraftOption(gains=[], nodes=[0])] * 7
    assert best_depths(one, 8, lambda tokens, widest, drafting: costs.step_seconds(tokens, 0.0, widest)) == [0] * 8
    # ...which the line through the wide steps would verify
    assert best_depths(one, 8, lambda tokens, widest, drafting: line.step_seconds(tokens, 0.0, tokens))[0] == 1
    # all eight at 60% pay for it together
    eight = [DraftOption(gains=[0.6], nodes=[0, 2])] * 8
    assert best_depths(eight, 8, lambda tokens, widest, drafting: costs.step_seconds(tokens, 0.0, widest)) == [1] * 8


def test_cost_model_fits_no_jump_without_one_token_steps():
    costs = _fed_a_compiled_curve(StepCostModel(), one_token_steps=False)
    a, jump, b, c = costs.coefficients()
    assert jump == 0.0 and b == pytest.approx(0.001, rel=0.2)


def test_cost_model_never_fits_a_negative_cost_per_token():
    costs = StepCostModel(draft_warm_up=0, min_draft_calls=1)
    for tokens in (1, 2, 3, 4, 5, 6):  # noise: more tokens measured faster
        costs.observe_step(tokens, 0.0, 0.050 - 0.001 * tokens)
    a, jump, b, c = costs.coefficients()
    assert jump == 0.0 and b == 0.0 and c == 0.0 and a == pytest.approx(0.0465, rel=0.05)
    costs.observe_draft(4, 0.008)
    assert costs.draft_seconds(2) == pytest.approx(0.004)


def test_cost_model_refits_every_few_steps_and_every_step_while_young():
    """A refit costs about 1% of a decode step in Python: the fit is made again every
    ``REFIT_EVERY`` steps once it has seen twice as many, and is never older than that."""
    costs = StepCostModel()
    every = costs.steps.REFIT_EVERY
    young = []
    for n in range(2 * every):
        costs.observe_step(1 + 3 * (n % 4), 0.0, 0.01 * (1 + n / 10) + 0.001 * (1 + 3 * (n % 4)))
        young.append(costs.coefficients())
    assert len(set(young)) == len(young)  # fitted again after every step
    before, fits = costs.coefficients(), []
    for _ in range(every):
        costs.observe_step(2, 0.0, 0.05)  # the machine slowed down
        fits.append(costs.coefficients())
    assert fits[:-1] == [before] * (every - 1) and fits[-1][0] > before[0]  # refit at the fourth step


def test_cost_model_keeps_a_token_price_while_every_step_had_the_same_tokens():
    """Eight long prompts, prefilled in three 512-token chunks: nothing tells what a token
    costs, and a fit made tokens free (the next step then ran every lookahead window)."""
    costs = StepCostModel()
    for _ in range(3):
        costs.observe_step(512, 0.0, 0.5)
    assert costs.step_seconds(16) - costs.step_seconds(1) > 15 * 0.5 / 1000
    for tokens in (8, 8, 24, 8):  # then decode steps, one of them verifying drafts: the data price a token
        costs.observe_step(tokens, 0.0, 0.060 + 0.0008 * tokens)
    a, jump, b, c = costs.coefficients()
    assert b > 0.0005 and a < 0.1


def test_attention_work_counts_the_padded_groups_the_torch_attention_runs():
    from specdec.executor.planner import StepShape, attention_work
    from specdec.kvcache.layout import GROUP_PAIRS
    from specdec.kvcache.layout import KEY_GATHER_PAIRS as G

    batch = StepShape([(300, 1)] * 8, padded=True)
    assert batch.work == pytest.approx((GROUP_PAIRS + 8 * 301 * (1 + G)) / 1000)
    # one request verifying 13 tokens: a padded group of its own, 13 queries over 313 keys
    own_group = (2 * GROUP_PAIRS + 7 * 301 * (1 + G) + 313 * (13 + G)) / 1000
    assert batch.work_at(20, 13, 1) == pytest.approx(own_group)
    assert batch.work_at(20, 13, 1) == pytest.approx(attention_work([(300, 1)] * 7 + [(300, 13)], True))
    # one verifying a single draft token: padding seven decodes to two rows costs less than a group
    assert batch.work_at(9, 2, 1) == pytest.approx((GROUP_PAIRS + 8 * 302 * (2 + G)) / 1000)
    paged = StepShape([(300, 1)] * 8, padded=False)
    assert paged.work_at(20, 13, 1) - paged.work == pytest.approx(12 * 302 / 1000)  # only its own queries
    with_prompt = StepShape([(0, 200), (300, 1)], padded=True)
    assert with_prompt.work == pytest.approx((2 * GROUP_PAIRS + 200 * (200 + G) + 301 * (1 + G)) / 1000)
    assert with_prompt.work_at(203, 3, 1) == pytest.approx((2 * GROUP_PAIRS + 200 * (200 + G) + 303 * (3 + G)) / 1000)


def test_draft_trees_cost_a_batch_of_their_own_in_the_batch_invariant_torch_attention():
    """The invariant torch attention runs a step's trees apart from its rows (a tree of
    four beside seven decodes measured 7-12 ms more than a chain of four): the planner
    prices that where the engine runs it, and only for trees."""
    from specdec.executor.planner import StepShape, attention_work
    from specdec.kvcache.layout import TREE_BATCH_PAIRS

    sequences = [(300, 1)] * 8
    invariant, stock = StepShape(sequences, padded=True, tree_batch=True), StepShape(sequences, padded=True)
    chain = invariant.work_at(11, 4, 1)
    assert chain == stock.work_at(11, 4, 1) == stock.work_at(11, 4, 1, trees=True)
    assert invariant.work_at(11, 4, 1, trees=True) == pytest.approx(chain + TREE_BATCH_PAIRS / 1000)
    assert invariant.work_at(8, 1, 0, trees=True) == invariant.work  # nothing drafted, no trees run
    assert attention_work(sequences, True, trees=True) == pytest.approx(invariant.work + TREE_BATCH_PAIRS / 1000)

    planner = DraftPlanner(lambda depth: 3 * depth, probe_interval=16)  # three nodes a level: a tree
    for _ in range(40):  # a machine where attention work is what a step costs
        for tokens, work in ((8, invariant.work), (11, chain), (11, chain + TREE_BATCH_PAIRS / 1000)):
            planner.costs.observe_step(tokens, work, 0.03 + work / 1000, 1 if tokens == 8 else 4)
    for tree_batch, expected in ((False, 0.0), (True, TREE_BATCH_PAIRS / 1e6)):
        shape = StepShape(sequences, padded=True, tree_batch=tree_batch)
        chain_step, tree_step = planner.step_seconds(shape)(11, 4, 1), planner.step_seconds(shape, trees=True)(11, 4, 1)
        assert tree_step - chain_step == pytest.approx(expected, rel=0.05, abs=1e-6)


def test_padded_groups_merge_where_padding_costs_less_than_a_group():
    from specdec.kvcache.layout import padded_groups

    assert padded_groups([(300, 1)] * 7 + [(300, 2)]) == [list(range(8))]
    assert padded_groups([(300, 1)] * 7 + [(300, 16)]) == [list(range(7)), [7]]
    assert padded_groups([(300, 1), (0, 512), (300, 1)]) == [[0, 2], [1]]
    # short contexts make padding cheap: decodes, a chain and a tree in one group
    assert padded_groups([(20, 1), (20, 3), (20, 9)]) == [[0, 1, 2]]


def test_acceptance_stats_follow_the_request_and_lean_on_the_prior():
    engine_wide = AcceptanceStats(decay=0.99, prior_weight=2.0)
    mine = AcceptanceStats(prior=engine_wide)
    assert mine.curve("x", 2) == pytest.approx([0.5, 0.25])  # nothing seen: the initial guess
    for _ in range(30):
        engine_wide.observe(3, depth=4, accepted=4)
        mine.observe(1, depth=4, accepted=0)
    # a kind the engine never verified is guessed as well as its verified drafts of every kind (all accepted)
    assert engine_wide.rate(1, 0) == pytest.approx(1.0) and engine_wide.rate("x", 0) == pytest.approx(1.0)
    assert 0.2 < mine.rate(1, 0) < 0.3  # its own one-token matches fail; the prior keeps it hopeful
    assert mine.rate(3, 0) > 0.9  # a kind it has not drafted: the engine-wide estimate
    for _ in range(30):
        engine_wide.observe(1, depth=4, accepted=0)
    assert mine.rate(1, 0) < 0.05  # the engine saw them fail too
    for _ in range(30):
        mine.observe(1, depth=4, accepted=2)
        engine_wide.observe(1, depth=4, accepted=2)
    assert mine.rate(1, 0) > 0.8 and mine.rate(1, 2) < 0.1  # followed the change (decay)
    assert mine.rate(1, 3) == pytest.approx(mine.rate(1, 2))  # never reached anywhere: like the one before
    assert mine.curve(3, 6)[-1] > 0.8  # the engine's kind-3 drafts, deeper than ever verified
    failing = AcceptanceStats(decay=0.99, prior_weight=2.0)
    for _ in range(30):
        failing.observe(3, depth=4, accepted=0)
    assert failing.rate(8, 0) == pytest.approx(0.5)  # drafts that fail: an unseen kind keeps the initial guess


def test_a_requests_estimate_leans_on_the_engine_wide_one_as_the_planner_says():
    """``DraftPlanner.request_prior_weight``: how many of a request's own observations the
    engine-wide estimate weighs as (what ``scripts/ab_planner.py`` varies)."""
    planner = DraftPlanner(lambda depth: depth, probe_interval=8)
    for _ in range(40):
        planner.stats.observe(3, depth=4, accepted=4)  # another request copies its prompt
    rates = {}
    for weight in (3.0, 1.0):
        planner.request_prior_weight = weight
        mine = planner.request_stats(types.SimpleNamespace(request_id=f"r{weight}"))
        for _ in range(4):
            mine.observe(3, depth=4, accepted=0)
        seen = sum(0.9 ** k for k in range(4))
        assert mine.rate(3, 0) == pytest.approx(weight * planner.stats.rate(3, 0) / (seen + weight))
        rates[weight] = mine.rate(3, 0)
    assert rates[3.0] > 0.45 and rates[1.0] < 0.25


def test_requests_lean_on_the_engine_wide_estimate_as_far_as_they_do_not_differ():
    """``AcceptanceSpread``: requests accepting at one rate (a trained drafter on
    open-ended text) earn the heaviest prior, so that a few rejected drafts do not hold
    one off; requests that differ (ngram copying or not) keep the lightest; the planner
    hands the weight to every request's estimate."""
    rng = random.Random(0)

    def weight(rates: list[float]) -> float:
        spread = AcceptanceSpread()
        blocks = [[0, 0] for _ in rates]
        for _ in range(400):
            for block, rate in zip(blocks, rates):
                spread.observe(block, rng.random() < rate)
        return spread.prior_weight()

    assert AcceptanceSpread().prior_weight() == 3.0  # nothing seen: the light prior
    assert weight([0.35] * 4) > 30.0  # the spread of chance alone (its estimate is noisy too)
    assert weight([0.9, 0.1, 0.9, 0.1]) == 3.0
    assert 8.0 < weight([0.25, 0.45] * 2) < 50.0  # differing a little: in between

    planner = DraftPlanner(lambda depth: depth, probe_interval=8)
    reqs = [types.SimpleNamespace(request_id=f"r{i}") for i in range(4)]
    proposal = DraftProposal(token_ids=[1])
    for _ in range(200):
        for req in reqs:
            planner.observe_verified(req, proposal, [0] if rng.random() < 0.35 else [])
    lean = planner.request_prior_weight
    assert lean > 30.0
    assert all(planner.request_stats(req).prior_weight == lean for req in reqs)
    assert planner.request_stats(types.SimpleNamespace(request_id="late")).prior_weight == lean


class PhasedDrafter:
    """Drafts the reference continuation, except while the output length is inside
    ``bad``, where every draft token is wrong; records what it was asked and what the
    target accepted."""

    def __init__(self, reference: list[int], prompt_len: int, bad: range, vocab_size: int):
        self.reference, self.prompt_len, self.bad, self.vocab = reference, prompt_len, bad, vocab_size
        self.asked: list[int] = []  # output length at each drafting call
        self.accepted: list[tuple[int, int]] = []  # (output length before the step, tokens accepted)

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        out = []
        for req, k in zip(requests, draft_lens):
            done = req.num_output_tokens
            self.asked.append(done)
            draft = self.reference[done:done + k]
            if done in self.bad:
                draft = [(t + 1) % self.vocab for t in draft]
            out.append(DraftProposal(token_ids=draft) if draft else None)
        return out

    @hookimpl
    def on_draft_verified(self, results):
        for res in results:
            if res.proposal is not None:
                before = res.request.num_output_tokens - len(res.new_token_ids)
                self.accepted.append((before, len(res.accepted_nodes)))


def synthetic_costs() -> FixedCosts:
    """Each verified token costs a quarter of a one-token step; drafting is free."""
    return FixedCosts(step=1.0, per_token=0.25, per_level=0.0)


def test_speculation_switches_off_while_drafts_fail_and_back_on(tmp_path):
    model = testing.tiny_model_dir(tmp_path)
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    prompt = [3, 17, 9, 44, 5, 61, 12]
    reference = LLM(model=str(model), dtype="float32").generate([prompt], params)[0].token_ids
    drafter = PhasedDrafter(reference, len(prompt), bad=range(20, 70), vocab_size=128)
    llm = LLM(model=str(model), dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": drafter, "max_draft_len": 4, "probe_interval": 6})
    llm.engine.planner.costs = synthetic_costs()
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == reference
    assert out.metrics.num_steps_speculation_off > 10
    bad_calls = [n for n in drafter.asked if 40 <= n < 70]
    assert 0 < len(bad_calls) <= len(range(40, 70)) // 6 + 1  # only probes once the estimate fell
    assert sum(a for n, a in drafter.accepted if n >= 75) > 10  # a probe found drafts paying again
    assert sum(a for n, a in drafter.accepted if n < 20) > 10


def test_adaptive_off_drafts_the_full_length(tmp_path):
    model = testing.tiny_model_dir(tmp_path)
    prompt = [3, 17, 9, 44, 5, 61, 12]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    reference = LLM(model=str(model), dtype="float32").generate([prompt], params)[0].token_ids
    drafter = PhasedDrafter(reference, len(prompt), bad=range(0, 40), vocab_size=128)
    llm = LLM(model=str(model), dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": drafter, "max_draft_len": 4, "adaptive": False})
    out = llm.generate([prompt], params)[0]
    assert not llm.engine.planner.adaptive
    assert out.token_ids == reference and out.metrics.num_steps_speculation_off == 0
    assert out.metrics.draft_len_counts[4] >= out.metrics.num_steps - 4  # all but the steps near max_tokens


def test_manual_rules_replace_the_planner():
    from specdec.config_loading import config_from_dict

    spec = config_from_dict({"speculative_config": {"decoding_type": "ngram",
                                                    "draft_len_schedule": {1: 4, 8: 0}}}).speculative_config
    assert not spec.is_adaptive
    spec = config_from_dict({"speculative_config": {"decoding_type": "ngram"}}).speculative_config
    assert spec.is_adaptive


def planner_with(costs, probe_share=0.03):
    from specdec.executor.planner import DraftPlanner

    return DraftPlanner(nodes_for_depth=lambda depth: depth, probe_interval=4, probe_share=probe_share, costs=costs)


def request(name: str):
    from specdec.executor.request import Request

    return Request(request_id=name, token_ids=[1, 2, 3], prompt_len=3, sampling_params=SamplingParams())


def test_probes_back_off_while_they_fail_and_reset_when_drafts_pay():
    from specdec.executor.planner import StepShape

    planner, req = planner_with(synthetic_costs(), probe_share=1e9), request("a")  # a budget that never binds
    shape = StepShape([(10, 1)], padded=True)
    for _ in range(20):
        planner.observe(req, None, depth=4, accepted=0)
    waits, since = [], 0
    for _ in range(130):  # steps: plan, and the engine's bookkeeping of a step without drafts
        planner.observe_cost(1, 0.0, 1.0, 1)
        ((depth, _),) = planner.plan([req], [(4, 4)], shape)
        if depth:
            waits.append(since)
            since = 0
            (kept,) = planner.trim([req], [DraftProposal(token_ids=[5] * depth)], shape)
            assert kept.depth == 1  # a probe is verified even though the estimate says no
            planner.observe(req, None, depth=1, accepted=0)
            planner.state(req).steps_without_drafts = 0
        else:
            since += 1
            planner.state(req).steps_without_drafts += 1
    assert waits[:5] == [4, 8, 16, 32, 32]  # doubling, up to 8x probe_interval
    for _ in range(10):
        planner.observe(req, None, depth=4, accepted=4)
    ((depth, _),) = planner.plan([req], [(4, 4)], shape)
    assert depth == 4
    (kept,) = planner.trim([req], [DraftProposal(token_ids=[5] * 4)], shape)
    assert kept.depth == 4 and planner.state(req).probe_after == 0  # drafts pay again: probes back to the default


def probing_run(probe_share: float, steps: int = 400) -> tuple[float, float, set]:
    """Eight requests whose drafts never pay, each proposal bringing 15 aux tokens
    (lookahead's window) over a step of eight one-token sequences: the seconds the probes
    added, the seconds of all steps, and the requests probed."""
    from specdec.executor.planner import StepShape

    costs = synthetic_costs()
    planner, reqs = planner_with(costs, probe_share), [request(f"r{i}") for i in range(8)]
    planner.aux_tokens = 15.0
    shape = StepShape([(10, 1)] * 8, padded=False)
    for req in reqs:
        for _ in range(20):
            planner.observe(req, None, depth=4, accepted=0)
    spent, elapsed, probed = 0.0, 0.0, set()
    for _ in range(steps):
        depths = [d for d, _ in planner.plan(reqs, [(4, 4)] * 8, shape)]
        proposals = [DraftProposal(token_ids=[5] * d, aux_token_ids=[7] * 15, aux_position_offsets=list(range(15)))
                     if d else None for d in depths]
        kept = planner.trim(reqs, proposals, shape)
        tokens = 8 + sum(1 + 15 for k in kept if k)
        spent += costs.step_seconds(tokens) - costs.step_seconds(8)
        elapsed += costs.step_seconds(tokens)
        planner.observe_cost(tokens, 0.0, costs.step_seconds(tokens), 16 if any(kept) else 1)
        for req, k in zip(reqs, kept):
            if k:
                probed.add(req.request_id)
                planner.observe(req, None, depth=k.depth, accepted=0)
            planner.state(req).steps_without_drafts = 0 if k else planner.state(req).steps_without_drafts + 1
    return spent, elapsed, probed


def test_probes_of_a_batch_spend_at_most_their_share_of_the_step_time():
    spent, elapsed, probed = probing_run(probe_share=0.03, steps=3000)
    assert len(probed) == 8  # every request still gets probed...
    assert spent <= 0.03 / 4 * elapsed  # ...within the budget, which halved while no probe paid
    spent, elapsed, probed = probing_run(probe_share=1e9)  # no budget
    assert spent > 0.15 * elapsed  # each on its own schedule, probes would cost far more


def test_the_probe_share_halves_while_probes_do_not_pay_and_comes_back_when_drafts_do():
    from specdec.executor.planner import PROBE_SHARE_HALVINGS, StepShape

    planner, req = planner_with(synthetic_costs(), probe_share=0.4), request("a")  # a step pays two probes
    shape = StepShape([(10, 1)], padded=True)
    for _ in range(20):
        planner.observe(req, None, depth=4, accepted=0)
    shares = []
    for _ in range(400):
        planner.observe_cost(1, 0.0, 1.0, 1)
        ((depth, _),) = planner.plan([req], [(4, 4)], shape)
        if depth:
            shares.append(planner.probes.share_now)
            (kept,) = planner.trim([req], [DraftProposal(token_ids=[5] * depth)], shape)
            planner.observe(req, None, depth=kept.depth, accepted=0)
        planner.state(req).steps_without_drafts = 0 if depth else planner.state(req).steps_without_drafts + 1
    assert shares[:5] == [0.2, 0.1, 0.05, 0.05, 0.05]  # halved by each probe, down to an eighth
    assert PROBE_SHARE_HALVINGS == 3
    for _ in range(10):
        planner.observe(req, None, depth=4, accepted=4)
    (kept,) = planner.trim([req], [DraftProposal(token_ids=[5] * 4)], shape)
    assert kept.depth == 4 and planner.probes.share_now == 0.4  # a draft kept on its merit: the whole share


def dear_drafting() -> FixedCosts:
    """Drafting a level costs half a step (a drafter that first feeds the rows it missed):
    a draft pays before drafting only where it is nearly sure, after drafting (the time
    spent) where it is as likely as not."""
    return FixedCosts(step=1.0, per_token=0.25, per_level=0.5)


def test_a_probe_that_looks_worth_verifying_once_drafted_is_still_a_probe():
    """A probe's draft, its drafting time spent, may be worth verifying by the estimate
    (trim); that says nothing of whether drafting pays (plan), so the probe share still
    halves and the request's next probe still waits twice as long."""
    from specdec.executor.planner import StepShape

    planner, req = planner_with(dear_drafting(), probe_share=0.4), request("a")
    shape = StepShape([(10, 1)], padded=True)
    for _ in range(20):
        planner.observe(req, None, depth=1, accepted=1 if _ % 2 else 0)  # accepted half the time
    probes = []
    for _ in range(60):
        planner.observe_cost(1, 0.0, 1.0, 1)
        ((depth, _),) = planner.plan([req], [(1, 1)], shape)
        if depth:
            (kept,) = planner.trim([req], [DraftProposal(token_ids=[5])], shape)
            assert kept.depth == 1  # worth verifying once drafted
            probes.append((planner.probes.share_now, planner.state(req).probe_after))
        planner.state(req).steps_without_drafts = 0 if depth else planner.state(req).steps_without_drafts + 1
    assert probes[:3] == [(0.2, 8), (0.1, 16), (0.05, 32)]


def test_each_probe_pays_for_its_drafting_and_an_untimed_drafter_is_probed_one_request_a_step():
    from specdec.executor.planner import StepShape

    costs = dear_drafting()
    planner, reqs = planner_with(costs, probe_share=0.4), [request(f"r{i}") for i in range(8)]
    shape = StepShape([(10, 1)] * 8, padded=True)
    for req in reqs:
        for _ in range(20):
            planner.observe(req, None, depth=1, accepted=0)
        planner.state(req).steps_without_drafts = 4  # every one due for a probe
    planner.probes.credit = 2.0  # four probes' drafting, or two with their tokens
    probing = sum(d for d, _ in planner.plan(reqs, [(1, 1)] * 8, shape))
    assert probing == 2 and planner.probes.credit < 1.0
    costs.per_level = 0.0  # no drafting timed yet
    planner.probes.credit = 100.0
    assert sum(d for d, _ in planner.plan(reqs, [(1, 1)] * 8, shape)) == 1


def test_a_probe_pays_for_the_tokens_its_drafter_catches_up_on():
    """A drafter reading the target's states runs every row a request decoded while off at
    its next call: a probe after a long spell off costs that too, and the budget pays for
    the request just off first where it cannot pay for both."""
    from specdec.executor.planner import StepShape

    costs = FixedCosts(step=1.0, per_token=0.0, per_level=0.1, per_caught_up=0.01)
    planner, (near, far) = planner_with(costs, probe_share=0.4), [request("near"), request("far")]
    shape = StepShape([(10, 1)] * 2, padded=True)
    for req, behind in ((near, 4), (far, 300)):
        for _ in range(20):
            planner.observe(req, None, depth=1, accepted=0)
        req.token_ids += [7] * behind
        planner.state(req).drafted_at = 3
        planner.state(req).steps_without_drafts = 40 if req is far else 4  # the far one longest overdue
    planner.probes.credit = 1.0  # the near probe (0.14) and not the far one (3.1)
    depths = [d for d, _ in planner.plan([near, far], [(1, 1)] * 2, shape)]
    assert depths == [1, 0] and planner.probes.credit == pytest.approx(1.0 - 0.14)
    planner.probes.credit = 3.2
    assert [d for d, _ in planner.plan([near, far], [(1, 1)] * 2, shape)] == [0, 1]  # paid for in the end
    planner.observe_drafting([far], 1, 3.1, trees=False)
    assert planner._behind(far) == 0


def cheap_tokens() -> FixedCosts:
    """Each verified token costs 1/500 of a step: asking for drafts looks worth it."""
    return FixedCosts(step=1.0, per_token=0.002, per_level=0.0)


@pytest.mark.parametrize("probe_share", [0.03, 0.1])
def test_warm_ups_bringing_aux_tokens_only_spend_at_most_the_probe_share(probe_share):
    """A drafter still filling its state (lookahead's window before its pool has a match)
    brings no token this step: its aux tokens run only as far as the probe budget goes,
    every request in turn, however cheap they look to plan()."""
    from specdec.executor.planner import StepShape

    costs = cheap_tokens()
    planner, reqs = planner_with(costs, probe_share), [request(f"r{i}") for i in range(8)]
    shape = StepShape([(10, 1)] * 8, padded=False)
    spent, elapsed, warmed, asked = 0.0, 0.0, collections.Counter(), 0
    for _ in range(400):
        depths = [d for d, _ in planner.plan(reqs, [(4, 4)] * 8, shape)]
        asked += sum(d > 0 for d in depths)
        proposals = [DraftProposal(token_ids=[], aux_token_ids=[7] * 15, aux_position_offsets=list(range(1, 16)))
                     if d else None for d in depths]
        planner.observe_asks(reqs, proposals)
        kept = planner.trim(reqs, proposals, shape)
        tokens = 8 + sum(len(k.aux_token_ids) for k in kept if k is not None)
        spent += costs.step_seconds(tokens) - costs.step_seconds(8)
        elapsed += costs.step_seconds(tokens)
        planner.observe_cost(tokens, 0.0, costs.step_seconds(tokens), 16 if tokens > 8 else 1)
        for req, k in zip(reqs, kept):
            warmed[req.request_id] += k is not None
            planner.state(req).steps_without_drafts += 1
    assert asked > 8 * 300  # plan() asks nearly every request every step...
    assert len(warmed) == 8 and max(warmed.values()) - min(warmed.values()) <= 2  # ...each warms up in turn...
    # ...within the budget (all kept: 19% of the time), which halved while no warm-up brought a draft
    assert probe_share / 16 < spent / elapsed <= probe_share / 4


def test_a_cold_planner_lets_one_request_of_a_batch_verify_drafts_until_some_were_measured():
    """Until a few drafts were verified the acceptance is a guess: one request (the one
    expecting the most) finds out what drafts bring, then the batch drafts on the estimate."""
    from specdec.executor.planner import COLD_START_DRAFTS, StepShape

    planner, reqs = planner_with(cheap_tokens()), [request(f"r{i}") for i in range(8)]
    shape = StepShape([(10, 1)] * 8, padded=False)
    planner.request_stats(reqs[3]).observe("long match", 4, 4)  # r3 has a draft kind known to pay
    verifying, first = [], []
    for _ in range(COLD_START_DRAFTS + 2):
        proposals = [DraftProposal(token_ids=[5] * 4, kind="long match" if r is reqs[3] else None) for r in reqs]
        kept = planner.trim(reqs, proposals, shape)
        verifying.append(sum(k is not None for k in kept))
        first.append(next(r.request_id for r, k in zip(reqs, kept) if k is not None))
        for req, k in zip(reqs, kept):
            if k is not None:
                planner.observe(req, k.kind, depth=k.depth, accepted=2)
    assert verifying == [1] * COLD_START_DRAFTS + [8, 8]
    assert first[0] == "r3"


def test_a_drafter_that_rarely_has_a_draft_is_asked_only_where_asking_is_cheap():
    from specdec.executor.planner import StepShape

    shape = StepShape([(10, 1)], padded=True)
    dear = FixedCosts(step=1.0, per_token=0.25, per_level=0.3)  # each drafted level costs 30% of a step
    for costs, expected in ((synthetic_costs(), 4), (dear, 0)):
        planner, req = planner_with(costs), request("b")
        for _ in range(30):
            planner.observe(req, None, depth=4, accepted=4)  # its drafts are always right...
            planner.observe_asks([req], [None])  # ...but it rarely has one
        assert planner.request_stats(req).draft_rate() < 0.2
        assert planner.plan([req], [(4, 4)], shape) == [(expected, expected)]


def test_prompt_chunks_are_no_jump_for_the_cost_model(tiny_models):
    """The planner prices a step by its widest *decoding* sequence: a step whose prompt
    chunk is wide but whose decodes verify nothing is priced by its tokens and attention,
    not as the jump a draft brings (read as one, long prompts made every later draft look
    dear)."""
    llm = LLM(model=str(tiny_models["llama"]), dtype="float32", engine={"max_num_tokens": 16},
              speculative_config={"decoding_type": "ngram"})
    engine, seen = llm.engine, []
    forward, observe = engine.forward, engine.planner.observe_cost

    def recording_forward(items):
        seen.append((any(it.is_prefill for it in items),
                     max((len(it.tokens) for it in items if not it.is_prefill), default=1)))
        return forward(items)

    def recording_observe(num_tokens, work, seconds, widest):
        seen[-1] += (widest,)
        return observe(num_tokens, work, seconds, widest)

    engine.forward, engine.planner.observe_cost = recording_forward, recording_observe
    prompts = [[5, 6, 7, 8] * 10, [9, 10, 11, 12] * 10, [3, 4] * 12]
    llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    assert all(widest == decode_widest for _, decode_widest, widest in seen)  # drafts or not
    assert sum(prefill and widest == 1 for prefill, _, widest in seen) >= 5  # 16-token chunks of 104 tokens


def test_a_tree_drafter_gets_the_chain_or_the_tree_whichever_pays_more_for_the_request():
    """With ``chain_or_tree`` the planner keeps one estimate for the trees (``TREE_KIND``)
    and one for the chains, and asks each request for the shape that pays more: a request
    whose chains are accepted deep gets a chain (a tree's extra nodes would cost more than
    they add); one whose chains fail early but whose trees hold the right token gets the
    tree; the answer is (depth, nodes) with nodes == depth for a chain."""
    from specdec.drafting.interface import TREE_KIND
    from specdec.executor.planner import DraftPlanner, StepShape

    planner = DraftPlanner(nodes_for_depth=lambda depth: 3 * depth + 1, probe_interval=4, chain_or_tree=True)
    planner.costs = cheap_tokens()
    copying, guessing, fresh = request("copying"), request("guessing"), request("fresh")
    for _ in range(40):
        planner.request_stats(copying).observe(None, depth=3, accepted=3)  # its chains: all accepted
        planner.request_stats(copying).observe(TREE_KIND, depth=3, accepted=3)  # trees accept no more
        planner.request_stats(guessing).observe(None, depth=3, accepted=0)  # its chains fail at once...
        planner.request_stats(guessing).observe(TREE_KIND, depth=3, accepted=3)  # ...a sibling is right
    shape = StepShape([(10, 1)], padded=True)
    assert planner.plan([copying], [(3, 10)], shape) == [(3, 3)]
    assert planner.plan([guessing], [(3, 10)], shape) == [(3, 10)]
    assert planner.plan([copying, guessing], [(3, 10)] * 2, StepShape([(10, 1)] * 2, padded=True)) == [(3, 3), (3, 10)]
    # a request with no evidence of either starts with the same guess for both: the chain
    # brings as much for fewer nodes; once its chains fail, the tree is tried
    assert planner.plan([fresh], [(3, 10)], shape) == [(3, 3)]
    for _ in range(10):
        planner.request_stats(fresh).observe(None, depth=3, accepted=0)
    ((depth, nodes),) = planner.plan([fresh], [(3, 10)], shape)
    assert nodes > depth > 0
    # without chain_or_tree (a method whose drafter cannot draft a chain in place of its
    # tree): the tree, its nodes from the depth
    plain = DraftPlanner(nodes_for_depth=lambda depth: 3 * depth + 1, probe_interval=4)
    plain.costs = cheap_tokens()
    plain.request_stats(copying).counts = planner.request_stats(copying).counts
    assert plain.plan([copying], [(3, 10)], shape) == [(3, 10)]


def test_chains_and_trees_are_timed_apart_when_drafted():
    costs = StepCostModel(draft_warm_up=0, min_draft_calls=1)
    costs.observe_draft(2, 0.004, trees=True)
    assert costs.draft_seconds(2) == costs.draft_seconds(2, trees=True) == pytest.approx(0.004)  # chains not timed yet
    costs.observe_draft(2, 0.002)
    assert costs.draft_seconds(3) == pytest.approx(0.003)
    assert costs.draft_seconds(3, trees=True) == pytest.approx(0.006)


def test_a_drafters_catch_up_after_a_pause_is_priced_apart_from_its_levels():
    """A drafter reading the target's states first runs the tokens its requests gained
    since it was last asked: after a pause (a new request's prompt, steps without drafts)
    that is hundreds of tokens. Divided among the levels, a level looked three times its
    price and drafts stayed off where a chain of one paid."""
    level, call, per_token = 0.0008, 0.0002, 0.00001
    costs = StepCostModel(draft_warm_up=0, min_draft_calls=1)
    for depth, caught_up in [(1, 300), (1, 2), (2, 3), (1, 2), (1, 120), (3, 2), (1, 3), (2, 2), (1, 40), (1, 2)]:
        costs.observe_draft(depth, call + level * depth + per_token * caught_up, caught_up=caught_up)
    assert costs.draft_seconds(1, caught_up=2) == pytest.approx(call + level + 2 * per_token, rel=0.02)
    assert costs.draft_seconds(3) - costs.draft_seconds(2) == pytest.approx(level, rel=0.02)
    assert costs.draft_seconds(1, caught_up=300) == pytest.approx(call + level + 300 * per_token, rel=0.02)


def test_a_drafting_stall_neither_prices_drafts_out_nor_lingers():
    """The cost model learns what drafting costs only from the drafts the planner asks for:
    a call priced so dear that drafts stop is never measured again. A process's first
    calls (hundreds of times the next in a process that built several engines) are not
    observed, drafting is untimed until a few calls were, a later stall counts a few times
    its estimate at most, and a fit made of a stall starts again from the next call."""
    costs = StepCostModel()
    costs.observe_draft(1, 0.5, caught_up=40)
    costs.observe_draft(1, 0.5, caught_up=40)
    assert costs.draft_seconds(1) == 0.0  # warm-up calls: untimed
    for caught_up in (40, 2, 1):
        costs.observe_draft(1, 0.002 + 1e-5 * caught_up, caught_up=caught_up)
    assert costs.draft_seconds(1, caught_up=1) == pytest.approx(0.00201, rel=0.05)
    costs.observe_draft(1, 0.6, caught_up=2)  # a stall: counted at four times 2 ms
    assert 0.002 < costs.draft_seconds(1, caught_up=2) < 0.004
    for _ in range(30):  # the machine really slows down five times: followed
        costs.observe_draft(1, 0.01, caught_up=2)
    assert costs.draft_seconds(1, caught_up=2) == pytest.approx(0.01, rel=0.1)

    first = StepCostModel(draft_warm_up=0, min_draft_calls=1)
    for _ in range(5):
        first.observe_draft(1, 0.002, caught_up=2)
    first.observe_draft(1, 0.2, caught_up=300)  # larger than any call seen: counted as measured
    assert first.draft_seconds(1, caught_up=300) == pytest.approx(0.2, rel=0.05)

    first = StepCostModel(draft_warm_up=0, min_draft_calls=1)
    first.observe_draft(1, 0.5, caught_up=2)  # a stall on the first call observed
    assert first.draft_seconds(1, caught_up=2) == pytest.approx(0.5)
    first.observe_draft(1, 0.002, caught_up=2)
    assert first.draft_seconds(1, caught_up=2) == pytest.approx(0.002)


class StallingDrafter(PhasedDrafter):
    """The reference continuation, every draft right, but its first calls stall."""

    def __init__(self, reference: list[int], prompt_len: int, vocab_size: int, stalls: set[int]):
        super().__init__(reference, prompt_len, bad=range(0), vocab_size=vocab_size)
        self.stalls = stalls

    @hookimpl
    def prepare_draft_tokens(self, requests, draft_lens):
        if len(self.asked) in self.stalls:
            time.sleep(0.3)
        return super().prepare_draft_tokens(requests, draft_lens)


def test_drafts_that_pay_keep_being_drafted_after_the_drafters_first_calls_stall(tmp_path):
    """Priced from a stalled first call, a level cost a hundred steps and no draft was ever
    asked for again (the engine's third drafter in a process: its first call took 0.55 s)."""
    model = testing.tiny_model_dir(tmp_path)
    params = SamplingParams(max_tokens=80, temperature=0, ignore_eos=True)
    prompt = [3, 17, 9, 44, 5, 61, 12]
    reference = LLM(model=str(model), dtype="float32").generate([prompt], params)[0].token_ids
    drafter = StallingDrafter(reference, len(prompt), vocab_size=128, stalls={0, 2})
    llm = LLM(model=str(model), dtype="float32", speculative_config={
        "decoding_type": "user", "drafter": drafter, "max_draft_len": 4})
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == reference
    assert sum(a for n, a in drafter.accepted if n >= 40) >= 20


def test_the_planner_counts_what_each_request_gained_since_its_drafter_was_last_asked():
    seen = []

    class Recorded(FixedCosts):
        def observe_draft(self, depth, seconds, trees=False, caught_up=0):
            seen.append(caught_up)

    planner = DraftPlanner(nodes_for_depth=lambda depth: depth, probe_interval=4, costs=Recorded())
    new, old = types.SimpleNamespace(request_id="new", token_ids=list(range(50))), \
        types.SimpleNamespace(request_id="old", token_ids=list(range(80)))
    planner.state(old).drafted_at = 77
    planner.observe_drafting([new, old], 2, 0.001, trees=False)
    new.token_ids += [1, 2]
    planner.observe_drafting([new], 1, 0.001, trees=False)
    assert seen == [50 + 3, 2]
    assert planner.state(old).drafted_at == 80


def test_the_chain_inside_a_dynamic_tree_is_its_path_of_first_children():
    """A dynamic tree lists children likeliest first (``DynamicTree.expand`` adds top-k in
    order, ``rerank`` keeps node order), so its chain is the path of first children: what
    the engine counts as the chain's acceptance when it verifies the tree."""
    from specdec.drafting.interface import first_child_path
    from specdec.drafting.tree import DynamicTree

    tree = DynamicTree(top_k=2)
    tree.expand(torch.log_softmax(torch.tensor([[0.0, 3.0, 2.0, -1.0]]), -1))  # root: tokens 1, then 2
    tree.expand(torch.log_softmax(torch.tensor([[4.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 5.0]]), -1))
    tokens, parents, _ = tree.rerank(5)
    assert [tokens[n] for n in first_child_path(parents)] == [1, 0]  # the argmax at each level
    assert first_child_path([-1, -1, 0, 1, 2]) == [0, 2, 4]
    assert first_child_path([]) == []


# -- the probe budget on its own ------------------------------------------------------------

def test_the_probe_budget_saves_a_share_of_each_step_up_to_a_cap_and_halves_it_per_unpaid_probe():
    from specdec.executor.planner import PROBE_SHARE_HALVINGS, ProbeBudget

    budget = ProbeBudget(interval=4, share=0.1)
    budget.earn(1.0)
    assert budget.credit == pytest.approx(0.1)
    for _ in range(10_000):
        budget.earn(1.0)
    assert budget.credit == pytest.approx(0.1 * 4 * 8 * 4)  # four of the longest back-offs at most
    assert budget.afford(1.0) and not budget.afford(budget.credit + 1.0)
    state = RequestDraftState()
    shares = []
    for _ in range(PROBE_SHARE_HALVINGS + 2):
        budget.probed(state)
        shares.append(budget.share_now)
    assert shares == [0.05, 0.025, 0.0125, 0.0125, 0.0125]  # down to an eighth, no further
    budget.paid_off(state)
    assert budget.share_now == 0.1 and state.probe_after == 0


def test_a_request_is_probed_after_the_interval_then_after_twice_as_long_up_to_eight_times():
    from specdec.executor.planner import ProbeBudget

    budget, state, waits = ProbeBudget(interval=4, share=0.1), RequestDraftState(), []
    for _ in range(5):
        steps = 0
        while not budget.due(state):
            state.steps_without_drafts += 1
            steps += 1
        waits.append(steps)
        budget.probed(state)
    assert waits == [4, 8, 16, 32, 32]
    states = {i: RequestDraftState(steps_without_drafts=n) for i, n in enumerate([3, 9, 5])}
    assert budget.overdue_first(states) == [1, 2]  # due ones only, the longest overdue first


def test_the_budget_pays_candidates_in_order_while_it_holds_their_tokens():
    from specdec.executor.planner import DraftOption, ProbeBudget, StepLoad

    budget = ProbeBudget(interval=4, share=0.1)
    budget.credit = 0.6
    load = StepLoad(base_tokens=4, options=[DraftOption([], [0])] * 4, depths=[0] * 4)
    step = lambda tokens, widest, drafting: 1.0 + 0.25 * tokens  # noqa: E731
    assert budget.paid_from([2, 0, 1], lambda i: 1, load, step) == [2, 0]  # 0.25 each, the third not held
    assert load.tokens == 6 and budget.credit == pytest.approx(0.1)


def test_a_lone_decode_that_runs_two_rows_prices_its_first_draft_token_at_no_row():
    """The batch-invariant compiled graph runs a lone token twice (``min_rows`` 2): a
    decode's first draft token adds no row there. A draft accepted an eighth of the time,
    where a row costs a sixth of a step, pays there; priced as one row more, it does not."""
    from specdec.executor.planner import DraftPlanner, StepShape

    costs = FixedCosts(step=0.01, per_token=0.002, per_level=0.0)
    chosen = {}
    for min_rows in (1, 2):
        planner = DraftPlanner(nodes_for_depth=lambda depth: depth, probe_interval=10**6, probe_share=0.0,
                               costs=costs, min_rows=min_rows)
        req = request("r")
        for i in range(100):
            planner.observe(req, None, 1, int(i % 8 == 0))
        (chosen[min_rows],) = planner.plan([req], [(1, 1)], StepShape([(100, 1)], padded=False))
    assert chosen == {1: (0, 0), 2: (1, 1)}


def test_the_calibration_scales_each_position_by_what_the_verified_drafts_brought():
    calibration = AcceptanceCalibration(forgetting=1.0, min_expected=4.0)
    assert calibration.apply([0.8, 0.6]) == [0.8, 0.6]  # nothing verified yet: estimates as they are
    for i in range(10):  # expected 0.8 and 0.48 a draft; the first position reached 6 in 10, the second 3
        calibration.observe([0.8, 0.48], accepted=2 if i < 3 else 1 if i < 6 else 0)
    assert calibration.factor(0) == pytest.approx(6 / 8) and calibration.factor(1) == pytest.approx(3 / 4.8)
    assert calibration.factor(2) == 1.0  # never expected: no evidence either way
    assert calibration.apply([0.8, 0.48, 0.3]) == pytest.approx([0.6, 0.3, 0.3])
    for _ in range(100):
        calibration.observe([0.9], accepted=0)
    assert calibration.factor(0) == 0.5  # within [low, high]
    for _ in range(1000):
        calibration.observe([0.1], accepted=1)
    assert calibration.factor(0) == 1.0  # an estimate found too low is left as it is


def test_the_planner_prices_drafts_by_what_its_verified_drafts_brought():
    """The drafts the planner verifies were chosen on estimates that erred high more often
    than low: what the target accepted of them, against what was expected, scales the
    gains plan() and trim() price (AcceptanceCalibration), fed at every verified draft."""
    from specdec.executor.planner import StepShape

    costs = FixedCosts(step=1.0, per_token=0.5, per_level=0.0)  # a drafted row pays from 1/3 accepted
    planner, req = planner_with(costs), request("a")
    for i in range(60):
        planner.observe(req, "k", depth=1, accepted=int(i % 5 < 3))
    assert 0.5 < planner.request_stats(req).rate("k", 0) < 0.7
    shape = StepShape([(10, 1)], padded=True)
    draft = [DraftProposal(token_ids=[5], kind="k")]
    assert planner.plan([req], [(1, 1)], shape) == [(1, 1)]
    assert planner.trim([req], draft, shape)[0] is not None
    expected = planner.request_stats(req).curve("k", 1)
    for _ in range(20):  # drafts it verified were expected to bring 0.6 and brought nothing
        planner.observe_verified(req, draft[0], accepted_nodes=[])
    assert planner.calibration.expected[0] > 4 * expected[0] and planner.calibration.reached == [0.0]
    assert planner.calibration.factor(0) == 0.5  # priced at half the estimate: below a third
    req = request("b")  # a new request leaning on the same engine-wide estimate
    assert planner.plan([req], [(1, 1)], shape) == [(0, 0)]
    assert planner.trim([req], draft, shape)[0] is None


def test_a_batch_kept_from_drafting_rests_from_planning_while_its_requests_stay():
    """plan() runs every step while some request drafts; once it keeps the whole batch from
    drafting, the same requests go REST_STEPS - 1 steps without it (nothing it planned on
    changes without verified drafts), counted as speculation off; a request joining or
    leaving ends the rest."""
    from specdec.executor.planner import REST_STEPS, StepShape

    class Counting(DraftPlanner):
        calls = 0

        def plan(self, reqs, caps, shape):
            Counting.calls += 1
            return super().plan(reqs, caps, shape)

    dear = FixedCosts(step=1.0, per_token=2.0, per_level=0.0)  # a drafted row costs two steps
    planner = Counting(nodes_for_depth=lambda depth: depth, probe_interval=1000, costs=dear,
                       shape_for_batch=lambda batch_size: (4, 4))
    reqs = [request(f"r{i}") for i in range(3)]
    for req in reqs:
        for _ in range(10):
            planner.observe(req, None, depth=2, accepted=0)  # first positions accepted about one in ten
    shape = StepShape([(10, 1)] * 3, padded=False)

    def step(batch):
        return planner.shapes(batch, [4] * len(batch), len(batch), 1000, shape)

    steps = 2 * REST_STEPS - 1  # planned twice, the second rest not over
    assert [step(reqs) for _ in range(steps)] == [[(0, 0)] * 3] * steps
    assert Counting.calls == 2 and all(r.metrics.num_steps_speculation_off == steps for r in reqs)
    step(reqs[:2])  # one left: planned again
    assert Counting.calls == 3
    planner.costs = FixedCosts(step=1.0, per_token=0.0, per_level=0.0)  # rows now free
    assert step(reqs[:2]) == [(0, 0)] * 2 and Counting.calls == 3  # still resting
    while Counting.calls == 3:
        drafted = step(reqs[:2])
    assert all(d > 0 for d, _ in drafted) and Counting.calls == 4  # planned again after the rest: drafts pay
    step(reqs[:2])
    assert Counting.calls == 5  # drafting: planned every step


def test_a_lookup_draft_is_preferred_where_it_promises_as_many_tokens_a_second_as_the_methods():
    """Each priced alone in the step at its best depth: the method with its levels' drafting
    time, the lookup's draft (drafted already) without; the method's own depth is planned
    from its own estimate, not the lookup's kinds."""
    from specdec.executor.planner import StepShape

    shape = StepShape([(10, 1)], padded=True)
    planner, req = planner_with(FixedCosts(step=1.0, per_token=0.25, per_level=0.3)), request("a")
    long, short = (LOOKUP_KIND, 6), (LOOKUP_KIND, 1)
    for i in range(30):
        planner.observe(req, long, depth=4, accepted=4)  # long matches: always right
        planner.observe(req, short, depth=4, accepted=0)
        planner.observe(req, None, depth=3, accepted=int(i % 10 != 0))  # the method: its first position, 90%
    assert planner.plan([req], [(3, 3)], shape) == [(1, 1)]  # the long matches would pay for 3 levels
    four = [1, 2, 3, 4]
    lookups = [DraftProposal(token_ids=four, kind=long), DraftProposal(token_ids=four, kind=short), None]
    assert [planner.prefer_lookup([req], [prop], [(1, 1)], shape) for prop in lookups] == [[True], [False], [False]]
    # the method off this step: its draft is worth nothing, the lookup's is left to trim()
    assert planner.prefer_lookup([req], [DraftProposal(token_ids=four, kind=short)], [(0, 0)], shape) == [True]
    # a lookup kind right half the time against a method always right at depth 1: the
    # method's level decides it, free or at 60% of a step
    for per_level, want in ((0.0, [False]), (0.6, [True])):
        other = planner_with(FixedCosts(step=1.0, per_token=0.5, per_level=per_level))
        for i in range(30):
            other.observe(req, long, depth=4, accepted=4 * (i % 2))
            other.observe(req, None, depth=1, accepted=1)
        assert other.prefer_lookup([req], lookups[:1], [(1, 1)], shape) == want
    fixed = DraftPlanner(lambda depth: depth, probe_interval=4, adaptive=False)
    assert fixed.prefer_lookup([req] * 2, lookups[1:], [(3, 3)] * 2, None) == [True, False]  # wherever there is one


def test_a_lookup_draft_kept_where_the_method_was_off_is_no_step_without_drafts():
    from specdec.executor.planner import StepShape

    planner, req = planner_with(FixedCosts(step=1.0, per_token=0.01, per_level=0.9)), request("a")
    planner.shape_for_batch, planner.lookup_shape_for_batch = (lambda batch: (3, 3)), (lambda batch: (8, 8))
    for _ in range(30):
        planner.observe(req, None, depth=3, accepted=0)
        planner.observe(req, (LOOKUP_KIND, 5), depth=4, accepted=4)
        planner.observe(req, (LOOKUP_KIND, 1), depth=4, accepted=0)
    shape = StepShape([(10, 1)], padded=True)
    assert planner.shapes([req], [8], 1, 100, shape) == [(0, 0)]
    assert req.metrics.num_steps_speculation_off == 1  # the method was kept off...
    (kept,) = planner.trim([req], [DraftProposal(token_ids=[1, 2, 3, 4], kind=(LOOKUP_KIND, 5))], shape)
    assert kept.depth == 4 and req.metrics.num_steps_speculation_off == 0  # ...and the step drafted anyway
    planner.shapes([req], [8], 1, 100, shape)
    (kept,) = planner.trim([req], [DraftProposal(token_ids=[1, 2], kind=(LOOKUP_KIND, 1))], shape)
    assert kept is None and req.metrics.num_steps_speculation_off == 1  # off, and counted once


def test_a_lookup_that_brings_less_than_asking_costs_is_asked_one_step_in_eight():
    """Tokens accepted from its drafts per request asked, each worth the step's seconds per
    token, against the seconds asking took per request: a lookup that pays is asked every
    step, one that does not one step in ``LOOKUP_PROBE_INTERVAL``, which keeps its worth
    current; worth regained, every step again."""
    from specdec.executor.planner import StepShape
    from specdec.executor.planner.lookup_worth import LOOKUP_PROBE_INTERVAL

    planner = planner_with(FixedCosts(step=0.02, per_token=0.0, per_level=0.0))  # 20 ms a step
    planner.shape_for_batch = planner.lookup_shape_for_batch = lambda batch: (4, 4)
    reqs = [request(f"r{i}") for i in range(8)]
    shape = StepShape([(10, 1)] * 8, padded=True)  # a token of this batch: 2.5 ms

    def run(steps: int, accepted: int, seconds: float) -> list[bool]:
        asked = []
        for _ in range(steps):
            shapes = planner.lookup_shapes(reqs, [8] * 8, 8, 100, shape)
            asked.append(any(depth for depth, _ in shapes))
            if asked[-1]:
                planner.observe_lookup(8, seconds)
            planner.lookup_worth.observe_step(accepted if asked[-1] else 0)
        return asked

    assert all(run(40, accepted=2, seconds=8 * 100e-6))  # 0.25 tokens a request, worth 625 us > 100 us
    asked = run(80, accepted=0, seconds=8 * 100e-6)  # nothing accepted: 0.25 decays below 0.04
    assert sum(asked[-40:]) == 40 // LOOKUP_PROBE_INTERVAL
    assert all(run(40, accepted=8, seconds=8 * 100e-6)[LOOKUP_PROBE_INTERVAL:])  # a token a request again
