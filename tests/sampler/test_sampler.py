"""Acceptance rules: greedy exactness, and sampled output that follows the target distribution.

The statistical tests draw the first two output tokens many times through the real
acceptance code, with draft and target distributions taken from two tiny random models,
and compare their empirical joint distribution with the exact one (chi-square). A
deliberately wrong rule must fail the same test.
"""

import collections
from math import inf

import pytest
import torch

import specdec.sampler.acceptance as acceptance
from specdec import DraftProposal, SamplingParams
from specdec.errors import FieldError
from specdec.sampler import (
    TargetRows,
    nucleus_floor,
    pick_draft_token,
    probs_from_logits,
    shape_logits,
    verify_greedy,
    verify_greedy_batch,
    verify_sampled,
    verify_seeded,
)


def test_greedy_chain_and_tree():
    # rows: root, then nodes; target argmax per row
    chain = DraftProposal(token_ids=[5, 6, 7])
    assert verify_greedy([5, 6, 9, 1], chain).tokens == [5, 6, 9]
    assert verify_greedy([5, 6, 7, 1], chain).tokens == [5, 6, 7, 1]
    assert verify_greedy([4, 0, 0, 0], chain).tokens == [4]
    # tree: root -> (3, 5); 5 -> (6, 8); 8 -> 9
    tree = DraftProposal(token_ids=[3, 5, 6, 8, 9], parents=[-1, -1, 1, 1, 3])
    verdict = verify_greedy([5, 0, 8, 0, 9, 2], tree)
    assert verdict.accepted_nodes == [1, 3, 4] and verdict.tokens == [5, 8, 9, 2]
    assert verify_greedy([7, 0, 0, 0, 0, 0], tree).tokens == [7]


def test_penalties_biases_and_min_tokens_shape_each_row_from_its_own_history():
    """OpenAI's frequency and presence penalties count the output only (after the prompt),
    logit_bias adds to every row, min_tokens bans EOS and the stop ids while the output is
    short; each row depends on its own history alone."""
    logits = torch.zeros(3, 6)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, logit_bias={5: 2.0}, min_tokens=2,
                            stop_token_ids=(4,))
    histories = [[1, 2], [1, 2, 3], [1, 2, 3, 3, 1]]  # prompt [1, 2]; outputs [], [3], [3, 3, 1]
    got = shape_logits(logits, histories, params, prompt_len=2, end_ids={0})
    want = torch.tensor([
        [-inf, 0, 0, 0, -inf, 2],  # no output yet: EOS (0) and the stop id (4) banned
        [-inf, 0, 0, -0.75, -inf, 2],  # one 3: 0.5 + 0.25
        [0, -0.75, 0, -1.25, 0, 2],  # two 3s: 2 * 0.5 + 0.25; the prompt's 1 does not count, the output's does
    ])
    assert torch.equal(got, want)
    assert torch.equal(logits, torch.zeros(3, 6))  # the caller's logits are left alone
    assert shape_logits(logits, histories, SamplingParams(), 2, {0}) is logits  # nothing asked: nothing done
    with pytest.raises(FieldError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(FieldError, match="frequency_penalty"):
        SamplingParams(frequency_penalty=2.5)


def test_logits_processing():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and torch.allclose(p.sum(), torch.tensor(1.0))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert (p[0] > 0).tolist() == [True, False, False, False]
    p = probs_from_logits(logits, SamplingParams(temperature=0.0))
    assert p[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    hot = probs_from_logits(logits, SamplingParams(temperature=2.0))
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    assert hot[0, 0] < cold[0, 0]


def _sorted_nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The nucleus by a sort of the whole row: what :func:`nucleus_floor` must equal where
    no two probabilities tie."""
    ordered, order = probs.sort(dim=-1, descending=True)
    drop = (ordered.cumsum(-1) - ordered) >= top_p
    drop[..., 0] = False
    return ~torch.zeros_like(drop).scatter(-1, order, drop)


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0, 20.0])
def test_the_nucleus_found_by_partial_selection_is_the_sorted_one(scale):
    """Rows from flat (the window doubles up to the whole vocabulary) to peaked, several
    rows of different widths at once."""
    gen = torch.Generator().manual_seed(int(scale * 10))
    probs = torch.softmax(torch.randn(5, 49152, generator=gen) * scale, dim=-1)
    for top_p in (1e-6, 0.5, 0.9, 0.99):
        assert torch.equal(probs >= nucleus_floor(probs, top_p), _sorted_nucleus(probs, top_p))


def test_tied_probabilities_are_in_or_out_of_the_nucleus_together():
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.2], [0.25, 0.25, 0.25, 0.25], [0.1, 0.45, 0.1, 0.35]])
    kept = (probs >= nucleus_floor(probs, 0.5)).tolist()
    # row 0: 0.4 lies above each 0.2, less than 0.5, so every 0.2 is in (a sort would keep one of them)
    assert kept == [[True, True, True, True], [True, True, True, True], [False, True, False, True]]
    assert (probs >= nucleus_floor(probs, 1e-30)).tolist()[0] == [True, False, False, False]
    # a group of equals wider than the first window is kept whole, those beyond it too
    wide = torch.cat([torch.full((100,), 0.008), torch.full((100,), 0.002)])[None]
    assert (wide >= nucleus_floor(wide, 0.3)).sum() == 100 and (wide >= nucleus_floor(wide, 0.81)).sum() == 200


def test_only_requests_verified_by_rejection_sampling_draw_their_drafts():
    """Seeded verification keeps a draft where it equals the target's own draw, so a
    seeded request drafts the drafter's likeliest token, as a greedy one does; a request
    without a seed draws it from the drafter's distribution, handed on for rejection
    sampling over the target's vocabulary (the draft vocabulary's ids mapped)."""
    logits = torch.tensor([0.0, 3.0, 1.0, 2.5])
    to_target = torch.tensor([2, 5, 7, 9])
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3)):
        assert not params.draws_drafts
        assert pick_draft_token(logits, params, None, 12, to_target) == (5, None)
    params = SamplingParams(temperature=0.8)
    gen = torch.Generator().manual_seed(0)
    picks = collections.Counter()
    for _ in range(400):
        token, q = pick_draft_token(logits, params, gen, 12, to_target)
        picks[token] += 1
        assert torch.allclose(q[to_target], probs_from_logits(logits[None], params)[0]) and q.sum() == pytest.approx(1)
    assert set(picks) == {2, 5, 7, 9} and picks[5] > picks[9] > picks[7] > picks[2]


def test_extreme_settings_give_a_distribution_not_nans():
    """What a schema fuzzer sent the server: a top_p that float32 rounds to 0 keeps the
    likeliest token, a temperature whose division would overflow is greedy, and a
    repetition penalty outside 0.01-100 is refused."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    assert probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=5e-324))[0].tolist() == [1, 0, 0, 0]
    assert SamplingParams(temperature=1e-30).greedy
    assert probs_from_logits(logits, SamplingParams(temperature=1e-30))[0].tolist() == [1, 0, 0, 0]
    with pytest.raises(FieldError, match="repetition_penalty"):
        SamplingParams(repetition_penalty=5e-324)


class Tables:
    """Target and draft next-token distributions per prefix, from two tiny random models."""

    def __init__(self, tiny_dir_a, tiny_dir_b, params: SamplingParams):
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(tiny_dir_a, dtype=torch.float32).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(tiny_dir_b, dtype=torch.float32).eval()
        self.params = params
        self.cache = {}

    def probs(self, model, prefix: tuple) -> torch.Tensor:
        key = (id(model), prefix)
        if key not in self.cache:
            with torch.no_grad():
                logits = model(torch.tensor([[1, 2, *prefix]])).logits[0, -1:]
            self.cache[key] = probs_from_logits(logits, self.params)[0]
        return self.cache[key]

    def exact_pair(self) -> dict:
        p1 = self.probs(self.target, ())
        out = {}
        for a in torch.nonzero(p1).flatten().tolist():
            p2 = self.probs(self.target, (a,))
            for b in torch.nonzero(p2).flatten().tolist():
                out[(a, b)] = float(p1[a] * p2[b])
        return out


def draft_tree(tables, prefix, shape, gen):
    """Draft from q: 'chain' (2 tokens), 'iid'/'without_replacement'/'topk' trees (2 children, depth 2)."""
    q_of = lambda path: tables.probs(tables.draft, prefix + tuple(path))  # noqa: E731
    if shape == "chain":
        tokens, rows = [], []
        for _ in range(2):
            q = q_of(tokens)
            tokens.append(int(torch.multinomial(q, 1, generator=gen)))
            rows.append(q)
        return DraftProposal(token_ids=tokens, draft_probs=torch.stack(rows), sibling_sampling="iid")
    tokens, parents, rows = [], [], []

    def children(path, parent):
        q = q_of(path)
        if shape == "topk":
            picks = torch.topk(q, 2).indices.tolist()
        else:
            picks = torch.multinomial(q, 2, replacement=shape == "iid", generator=gen).tolist()
        made = []
        for tok in picks:
            tokens.append(tok)
            parents.append(parent)
            rows.append(q)
            made.append((len(tokens) - 1, tok))
        return made

    for node, tok in children([], -1):
        children([tok], node)
    sampling = {"iid": "iid", "without_replacement": "without_replacement", "topk": "deterministic"}[shape]
    return DraftProposal(token_ids=tokens, parents=parents, draft_probs=torch.stack(rows), sibling_sampling=sampling)


def sample_pairs(tables, shape, n, seed=0, ignore_q=False, seeded=False):
    """First two output tokens, ``n`` times. ``ignore_q``: a wrong rule that verifies drafts
    sampled from q as if q were uniform. ``seeded``: sample ``i`` is a request with seed
    ``seed * n + i`` whose prompt ends at position 17, verified by the seeded rule."""
    gen = torch.Generator().manual_seed(seed)
    counts = {}
    for i in range(n):
        out: list[int] = []
        while len(out) < 2:
            prefix = tuple(out)
            prop = draft_tree(tables, prefix, shape, gen)
            if ignore_q:
                prop.draft_probs = torch.full_like(prop.draft_probs, 1.0 / prop.draft_probs.shape[-1])
            paths = []
            for tok, parent in zip(prop.token_ids, prop.parents):
                paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
            target = torch.stack([tables.probs(tables.target, prefix)] +
                                 [tables.probs(tables.target, prefix + p) for p in paths])
            verdict = (verify_seeded(target, prop, seed * n + i, 17 + len(out)) if seeded
                       else verify_sampled(target, prop, gen))
            out.extend(verdict.tokens)
        key = (out[0], out[1])
        counts[key] = counts.get(key, 0) + 1
    return counts


def chi_square_p_value(counts: dict, exact: dict, n: int) -> float:
    unexpected = sum(c for k, c in counts.items() if exact.get(k, 0.0) == 0.0)
    if unexpected:
        return 0.0
    # pool cells with small expected counts so the chi-square approximation holds
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for key, prob in exact.items():
        expected, observed = prob * n, counts.get(key, 0)
        if expected < 5:
            pooled_obs += observed
            pooled_exp += expected
            continue
        stat += (observed - expected) ** 2 / expected
        dof += 1
    if pooled_exp > 0:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


SETTINGS = [SamplingParams(temperature=1.0, top_k=4), SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
            SamplingParams(temperature=1.3, top_k=5)]
N = 6000


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from specdec import testing

    root = tmp_path_factory.mktemp("pair")
    return testing.tiny_model_dir(root, seed=0, vocab_size=32), testing.tiny_model_dir(root, seed=1, vocab_size=32)


@pytest.mark.parametrize("shape", ["chain", "iid", "without_replacement", "topk"])
@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_sampled_output_follows_the_target_distribution(tiny_pair, shape, setting):
    tables = Tables(*tiny_pair, SETTINGS[setting])
    counts = sample_pairs(tables, shape, N, seed=setting)
    p = chi_square_p_value(counts, tables.exact_pair(), N)
    assert p > 1e-3, f"{shape} at {SETTINGS[setting]}: chi-square p-value {p:.2e}"


@pytest.mark.parametrize("shape", ["chain", "iid", "topk"])
def test_seeded_output_follows_the_target_distribution(tiny_pair, shape):
    """Each sample a request with a seed of its own: the seeded rule's draws, one uniform
    number per position, follow the target's distribution with drafts of every shape."""
    tables = Tables(*tiny_pair, SETTINGS[1])
    counts = sample_pairs(tables, shape, N, seed=1, seeded=True)
    p = chi_square_p_value(counts, tables.exact_pair(), N)
    assert p > 1e-3, f"seeded {shape}: chi-square p-value {p:.2e}"


def test_seeded_rule_with_one_number_for_every_position_fails_the_same_test(tiny_pair, monkeypatch):
    tables = Tables(*tiny_pair, SETTINGS[1])
    uniform = acceptance.position_uniform
    monkeypatch.setattr(acceptance, "position_uniform", lambda seed, position: uniform(seed, 0))
    p = chi_square_p_value(sample_pairs(tables, "chain", N, seed=1, seeded=True), tables.exact_pair(), N)
    assert p < 1e-3, f"the correlated rule passed (p-value {p:.2e})"


def test_a_seed_gives_the_same_tokens_whatever_was_drafted(tiny_pair):
    """The first two tokens of a seeded request are the same with no draft, a chain or a
    tree, drafted from anything, accepted or not: the seed and positions decide them."""
    tables = Tables(*tiny_pair, SETTINGS[0])
    gen = torch.Generator().manual_seed(5)
    for seed in range(40):
        outputs = set()
        for shape in (None, "chain", "iid", "topk", "chain"):
            out: list[int] = []
            while len(out) < 2:
                prefix = tuple(out)
                prop = None if shape is None else draft_tree(tables, prefix, shape, gen)
                paths = []
                for tok, parent in zip(prop.token_ids if prop else [], prop.parents if prop else []):
                    paths.append((paths[parent] if parent >= 0 else ()) + (tok,))
                target = torch.stack([tables.probs(tables.target, prefix)] +
                                     [tables.probs(tables.target, prefix + p) for p in paths])
                out.extend(verify_seeded(target, prop, seed, 9 + len(out)).tokens)
            outputs.add(tuple(out[:2]))
        assert len(outputs) == 1, (seed, outputs)


def test_position_uniforms_are_uniform_and_differ_by_seed_and_position():
    u = torch.tensor([acceptance.position_uniform(s, t) for s in range(100) for t in range(100)], dtype=torch.float64)
    assert 0.0 <= float(u.min()) and float(u.max()) < 1.0 and len(set(u.tolist())) == len(u)
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert float(((counts - 1000) ** 2 / 1000).sum()) < 27.9  # chi-square, 9 dof, p = 0.001
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    assert acceptance.sample_by_uniforms(probs, [0.0, 0.999]).tolist() == [1, 3]  # zero mass never drawn


@pytest.mark.parametrize("wrong", ["residual_without_q", "residual_without_clamp", "ignore_q"])
def test_a_wrong_rule_fails_the_same_test(tiny_pair, monkeypatch, wrong):
    tables = Tables(*tiny_pair, SETTINGS[0])
    if wrong == "residual_without_q":
        monkeypatch.setattr(acceptance, "_residual", lambda p, q: p)
    elif wrong == "residual_without_clamp":
        monkeypatch.setattr(acceptance, "_residual", lambda p, q: (p - q).abs() / (p - q).abs().sum())
    # residual rules live in the tree loop; a chain goes through the batched kernel's path
    counts = sample_pairs(tables, "chain" if wrong == "ignore_q" else "iid", N, seed=0, ignore_q=wrong == "ignore_q")
    p = chi_square_p_value(counts, tables.exact_pair(), N)
    assert p < 1e-3, f"the wrong rule {wrong} passed (p-value {p:.2e})"


class _Req:
    def __init__(self, greedy=True, token_ids=(), seed=0):
        self.sampling_params = SamplingParams(temperature=0.0 if greedy else 1.0)
        self.token_ids = list(token_ids)
        self.generator = torch.Generator().manual_seed(seed)


def test_typical_acceptance_accepts_plausible_non_argmax_tokens():
    from specdec.sampler.lossy import TypicalAcceptance

    # root row: flat-ish (high entropy) -> a low threshold; row after node 0: peaked
    probs = torch.tensor([[0.40, 0.35, 0.25, 0.0], [0.05, 0.05, 0.05, 0.85], [0.25, 0.25, 0.25, 0.25]])
    rule = TypicalAcceptance(posterior_threshold=0.3, posterior_alpha=0.3)
    prop = DraftProposal(token_ids=[1, 2])  # 1 is not the argmax of the root row, but plausible
    verdict = rule.verify(probs, probs.log(), prop, _Req(greedy=False))
    assert verdict.accepted_nodes == [0]  # token 2 has p=0.05 after node 0: rejected
    assert verdict.tokens[:1] == [1] and len(verdict.tokens) == 2
    exact = verify_greedy(probs.argmax(-1).tolist(), prop)
    assert exact.accepted_nodes == []  # the exact greedy rule rejects token 1


def test_relaxed_acceptance_only_inside_the_thinking_phase():
    from specdec.sampler.lossy import RelaxedAcceptance

    logits = torch.log(torch.tensor([[0.5, 0.45, 0.05], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8]]))
    prop = DraftProposal(token_ids=[1, 1])
    rule = RelaxedAcceptance(topk=2, delta=0.1, begin_token=7, end_token=8)
    thinking = _Req(token_ids=[5, 7, 3])
    verdict = rule.verify(logits.softmax(-1), logits, prop, thinking)
    assert verdict.accepted_nodes == [0]  # 1 is top-2 and within 0.1 of the top; then 0.3 < 0.6 - 0.1
    assert verdict.tokens == [1, 0]
    assert rule.verify(logits.softmax(-1), logits, prop, _Req(token_ids=[7, 3, 8])) is None
    assert RelaxedAcceptance(topk=1, delta=0.5).verify(logits.softmax(-1), logits, prop, thinking).accepted_nodes == []


def test_lossy_rules_are_opt_in_per_method_config():
    from specdec.config_loading import config_from_dict

    medusa = config_from_dict({"speculative_config": {"decoding_type": "medusa"}}).speculative_config
    assert medusa.acceptance_rule() is None
    medusa = config_from_dict({"speculative_config": {"decoding_type": "medusa", "use_typical_acceptance": True}})
    assert medusa.speculative_config.acceptance_rule().posterior_threshold == 0.09
    mtp = config_from_dict({"speculative_config": {"decoding_type": "mtp", "use_relaxed_acceptance_for_thinking": True,
                                                   "relaxed_topk": 3, "begin_thinking_phase_token": 7,
                                                   "end_thinking_phase_token": 8}}).speculative_config
    assert mtp.acceptance_rule().topk == 3


def test_target_rows_are_computed_when_read_each_from_its_own_path(monkeypatch):
    """A row read alone is the row computed with all the others (penalties over its own
    path's history), and rejection sampling computes only the rows its walk reads: here
    the target gives the root's children no chance, so only the root's row."""
    import specdec.sampler.logits as sampler_logits

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 3
    tree = DraftProposal(token_ids=[3, 5, 6, 8, 9], parents=[-1, -1, 1, 1, 3])
    params = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.3, presence_penalty=0.5)
    rows = TargetRows(logits, [1, 2, 5, 7], tree, params, prompt_len=2, end_ids=frozenset({0}))
    together = rows.all()
    assert all(torch.equal(rows[r], together[r]) for r in (4, 0, 5))
    assert not torch.equal(together[2], TargetRows(logits, [1, 2, 5, 7], tree, params, 2, frozenset({0})).all()[1])

    computed = []
    real = sampler_logits.probs_from_logits
    monkeypatch.setattr(sampler_logits, "probs_from_logits", lambda x, p: computed.append(len(x)) or real(x, p))
    logits[0, [3, 5]] = -inf
    verdict = verify_sampled(TargetRows(logits, [1, 2], tree, params, 2, frozenset({0})), tree, gen)
    assert verdict.accepted_nodes == [] and verdict.tokens[0] not in (3, 5)
    assert computed == [1]
    computed.clear()
    verify_seeded(TargetRows(logits, [1, 2], tree, params, 2, frozenset({0})), tree, seed=3, position=2)
    assert computed == [1]


def test_the_greedy_walk_gives_the_batched_kernels_verdicts():
    """Off CUDA, greedy verification walks each tree over the rows' tokens as a list; the
    batched kernel's torch reference (what the Triton kernel equals) gives the same nodes
    and tokens, on random trees whose nodes repeat tokens, siblings included."""
    from specdec.kernels import greedy_tree_verify_torch

    gen = torch.Generator().manual_seed(0)
    proposals = [None]
    for _ in range(60):
        n = int(torch.randint(1, 12, (), generator=gen))
        parents = [int(torch.randint(-1, k, (), generator=gen)) for k in range(n)]
        proposals.append(DraftProposal(token_ids=torch.randint(0, 3, (n,), generator=gen).tolist(), parents=parents))
    proposals.append(None)
    rows = sum(1 + (len(p.token_ids) if p is not None else 0) for p in proposals)
    target = torch.randint(0, 3, (rows,), generator=gen)
    got = verify_greedy_batch(target, proposals)
    packed = acceptance._pack(proposals, target.device)
    path, accepted, bonus = greedy_tree_verify_torch(target, *packed, 12, max(p.depth for p in proposals if p))
    assert sum(accepted.tolist()) > 30  # drafts were accepted, deep ones too
    for b, verdict in enumerate(got):
        nodes = path[b, :accepted[b]].tolist()
        assert verdict.accepted_nodes == nodes and verdict.tokens[-1] == int(bonus[b])
