"""Adaptive draft lengths: each step, the draft depth of every request that maximises the
expected tokens per second of the whole step, zero included.

Two live estimates feed the choice, both measured while serving (no calibration, no table
to tune):

* :class:`StepCostModel`: seconds of a step from the tokens of its target forward and the
  attention they do, and seconds of drafting per draft level.
* :class:`AcceptanceStats`: the chance that draft position ``j`` is accepted once position
  ``j - 1`` was, per proposal kind (ngram's match length, say), from counts that decay so
  the estimate follows the request; a request's estimate leans on the engine-wide one
  until it has evidence of its own.

:func:`best_depths` adds draft positions one at a time, the best expected gain per node
first over all requests, and keeps the prefix with the highest expected tokens per second.
The planner runs it before drafting (drafting time counted) and on the proposals (to trim
each to the depth its own kind earns). Where a drafter may grow a chain instead of its
dynamic tree, each request gets whichever pays more by its own estimates.

A request kept from drafting is probed with a one-level draft after ``probe_interval``
steps, then after twice as long each time the probe does not pay (up to 8x), so that
speculation comes back when it would pay again. Probes, and proposals of aux tokens only
(lookahead filling its pool), are paid from a budget shared by the batch, a share of every
step's estimated time that halves after each probe that led to no paying draft: a batch
whose drafts never pay loses at most that share. Until a few drafts were verified, one
request a step verifies its draft, since the batch's acceptance is a guess until then.
The runs behind these rules: "Speculation that never loses" in the benchmark diary
(``git show dd80fd5:BENCHMARKS.md``).
"""

from __future__ import annotations

import functools
import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable

import attrs

from ..config import SpeculativeConfig
from ..drafting import TREE_KIND, first_child_path
from ..kernels.layout import TREE_BATCH_PAIRS, padded_group_cost, padded_groups

#: the attention work of a step's draft trees run as a batch of their own, in thousands of pairs
TREE_BATCH_WORK = TREE_BATCH_PAIRS / 1000
#: drafts the engine verifies, one request a step, before a batch verifies drafts on the
#: acceptance it guesses
COLD_START_DRAFTS = 4
#: probes and warm-ups in a row that led to no draft worth verifying, after which the probe
#: share stops halving (an eighth of it)
PROBE_SHARE_HALVINGS = 3


class StepCostModel:
    """Seconds of a step, ``a + d * [widest > 1] + b * tokens + c * work``, and of drafting per level.

``tokens`` is the number of target tokens in the step's forward (weights are streamed
once per step, each token adds matmul rows); ``work`` the attention it does in thousands
of query-key pairs, which grows with the batch's contexts. ``d`` is the jump from a step
where every decoding sequence has one new token to one where some sequence (``widest``)
verifies drafts: a compiled target runs one token through a graph of its own, so the first
draft token can cost more than each later one. Prompt chunks do not count as wide (their
cost is in ``tokens`` and ``work``). The jump is fitted only while both kinds of step have
been seen recently. The coefficients come from least squares over every step seen, older
steps forgotten geometrically so that the model follows a machine that speeds up or slows
down, none of them negative (the best fit over the subsets of features is kept).
"""

    #: decayed number of one-token and of wider steps both needed before the jump is fitted
    MIN_STEPS_OF_EACH = 2.0

    def __init__(self, forgetting: float = 0.98, smoothing: float = 0.2):
        self.forgetting = forgetting
        self.smoothing = smoothing
        self.xtx = [[0.0] * 4 for _ in range(4)]
        self.xty = [0.0] * 4
        self.yty = 0.0
        self.num_steps = 0
        self._coefficients: tuple[float, float, float, float] | None = None
        self.draft_level_seconds = {False: 0.0, True: 0.0}  # chains, trees

    def observe_step(self, num_tokens: int, work: float, seconds: float, widest: int | None = None) -> None:
        """A step of ``num_tokens`` target tokens, ``widest`` of them in one sequence
        (None: a single sequence), took ``seconds``."""
        if num_tokens < 1 or seconds <= 0:
            return
        x = self._features(num_tokens, work, widest)
        f = self.forgetting
        for i in range(4):
            self.xty[i] = f * self.xty[i] + x[i] * seconds
            for j in range(4):
                self.xtx[i][j] = f * self.xtx[i][j] + x[i] * x[j]
        self.yty = f * self.yty + seconds * seconds
        self.num_steps += 1
        self._coefficients = None

    @staticmethod
    def _features(num_tokens: int, work: float, widest: int | None) -> tuple[float, float, float, float]:
        return 1.0, float((num_tokens if widest is None else widest) > 1), float(num_tokens), work

    def coefficients(self) -> tuple[float, float, float, float]:
        """(a, d, b, c) of the best non-negative fit; before three steps, or while every
        step had (nearly) the same number of tokens, the mean step time with a small
        per-token slope (drafts look nearly free, so speculation starts on and gets
        measured): steps all alike say nothing of what a token costs."""
        if self._coefficients is not None:
            return self._coefficients
        if self.num_steps < 3 or self._token_spread() < 1.0:
            mean = self.xty[0] / self.xtx[0][0] if self.num_steps else 1.0
            return mean, 0.0, mean / 256, 0.0
        wide = self.xtx[1][1]
        jump = min(wide, self.xtx[0][0] - wide) >= self.MIN_STEPS_OF_EACH
        subsets = [(0,), (0, 2), (0, 3), (0, 2, 3)]
        if jump:
            subsets += [(0, 1, *rest[1:]) for rest in subsets]
        best, best_residual = None, math.inf
        for features in subsets:
            beta = _solve([[self.xtx[i][j] + (1e-9 * self.xtx[i][i] if i == j else 0.0) for j in features]
                           for i in features], [self.xty[i] for i in features])
            if beta is None or any(v < 0 for v in beta):
                continue
            full = [0.0] * 4
            for i, v in zip(features, beta):
                full[i] = v
            residual = self.yty - 2 * sum(full[i] * self.xty[i] for i in range(4)) + sum(
                full[i] * self.xtx[i][j] * full[j] for i in range(4) for j in range(4))
            if residual < best_residual - 1e-15:
                best, best_residual = full, residual
        self._coefficients = tuple(best) if best is not None else (self.xty[0] / self.xtx[0][0], 0.0, 0.0, 0.0)
        return self._coefficients

    def _token_spread(self) -> float:
        """Standard deviation of the tokens of the steps seen (decayed weights)."""
        n = self.xtx[0][0]
        return math.sqrt(max(self.xtx[2][2] / n - (self.xtx[0][2] / n) ** 2, 0.0))

    def step_seconds(self, num_tokens: int, work: float = 0.0, widest: int | None = None) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), self._features(num_tokens, work, widest)))

    def observe_draft(self, depth: int, seconds: float, trees: bool = False) -> None:
        """A drafting call that asked for ``depth`` levels at most took ``seconds``
        (``trees``: some request was asked for more nodes than levels). Chains and trees
        are timed apart: a dynamic tree's level drafts several rows and ranks them."""
        if depth < 1:
            return
        per_level = seconds / depth
        if self.draft_level_seconds[trees] == 0.0:
            self.draft_level_seconds[trees] = per_level
        else:
            self.draft_level_seconds[trees] += self.smoothing * (per_level - self.draft_level_seconds[trees])

    def draft_seconds(self, depth: int, trees: bool = False) -> float:
        """Drafting time of ``depth`` levels; a kind not timed yet is priced as the other."""
        per_level = self.draft_level_seconds[trees] or self.draft_level_seconds[not trees]
        return per_level * depth


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting for the small normal equations; None if
    singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-300:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                factor = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= factor * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


@attrs.define
class AcceptanceStats:
    """Decayed counts, per proposal kind and draft position, of how often the position was
    reached (its parent accepted) and accepted; a position's rate leans on ``prior``
    (the engine-wide stats) with the weight of ``prior_weight`` observations."""

    decay: float = 0.9
    prior_weight: float = 3.0
    prior: AcceptanceStats | None = None
    initial_rate: float = 0.5
    counts: dict[Hashable, list[list[float]]] = attrs.Factory(dict)  # kind -> [[reached, accepted], ...]
    asks: list[float] = attrs.Factory(lambda: [0.0, 0.0])  # [times the drafter was asked, times it drafted]

    def observe_ask(self, drafted: bool) -> None:
        """The drafter was asked for a draft and proposed one (``drafted``) or nothing."""
        self.asks[0] = self.asks[0] * self.decay + 1.0
        self.asks[1] = self.asks[1] * self.decay + float(drafted)

    def draft_rate(self) -> float:
        """Chance that asking the drafter yields a draft (no match, an empty n-gram pool:
        asking costs drafting time and, for lookahead, its window, for nothing)."""
        prior = self.prior.draft_rate() if self.prior is not None else 1.0
        return (self.asks[1] + self.prior_weight * prior) / (self.asks[0] + self.prior_weight)

    def observe(self, kind: Hashable, depth: int, accepted: int) -> None:
        """A draft of ``kind`` and ``depth`` had its first ``accepted`` positions accepted."""
        rows = self.counts.setdefault(kind, [])
        for row in rows:
            row[0] *= self.decay
            row[1] *= self.decay
        while len(rows) < depth:
            rows.append([0.0, 0.0])
        for j in range(min(depth, accepted + 1)):
            rows[j][0] += 1.0
            if j < accepted:
                rows[j][1] += 1.0

    def rates(self, kind: Hashable, depth: int) -> list[float]:
        """For positions ``0..depth-1``, the chance that the position is accepted once the
        one before it was. A position leans on the engine-wide rate where that has seen
        it; else on this estimate's rate at the position before (a position never verified
        is guessed like the last one that was, so a request drafting short learns whether
        longer drafts would pay); position 0 without any evidence on the initial guess.
        The engine-wide estimate guesses a kind it never verified at least as well as its
        verified drafts of every kind together (:meth:`pooled_rates`), so that a new kind
        (a longer ngram match, say) is not refused on the initial guess alone."""
        rows = self.counts.get(kind, ())
        prior_rates = self.prior.rates(kind, depth) if self.prior is not None else None
        unseen = self.pooled_rates(depth) if self.prior is None and not self.has_seen(kind, 0) else None
        out: list[float] = []
        for j in range(depth):
            if prior_rates is not None and (j == 0 or self.prior.has_seen(kind, j)):
                prior = prior_rates[j]
            else:
                prior = out[j - 1] if j > 0 else self.initial_rate
                if unseen is not None and unseen[j] is not None:
                    prior = max(prior, unseen[j])
            if j < len(rows):
                reached, accepted = rows[j]
                out.append((accepted + self.prior_weight * prior) / (reached + self.prior_weight))
            else:
                out.append(prior)
        return out

    def pooled_rates(self, depth: int) -> list[float | None]:
        """For positions ``0..depth-1``, the share of the drafts that reached the position,
        of every kind together, that had it accepted (None where fewer than one reached it)."""
        out = []
        for j in range(depth):
            reached = accepted = 0.0
            for rows in self.counts.values():
                if j < len(rows):
                    reached += rows[j][0]
                    accepted += rows[j][1]
            out.append(accepted / reached if reached >= 1.0 else None)
        return out

    def rate(self, kind: Hashable, position: int) -> float:
        return self.rates(kind, position + 1)[position]

    def has_seen(self, kind: Hashable, position: int) -> bool:
        rows = self.counts.get(kind, ())
        return position < len(rows) and rows[position][0] >= 1.0

    def curve(self, kind: Hashable, depth: int) -> list[float]:
        """``P(at least j positions accepted)`` for ``j = 1..depth``."""
        out, p = [], 1.0
        for rate in self.rates(kind, depth):
            p *= rate
            out.append(p)
        return out

    def kinds(self) -> set:
        mine = set(self.counts)
        return mine | self.prior.kinds() if self.prior is not None else mine


def attention_work(sequences: list[tuple[int, int]], padded: bool, trees: bool = False) -> float:
    """Attention of a step in thousands of query-key pairs, for ``(cached, new)`` tokens of
    each sequence: the torch reference pads the sequences of each of its groups to the
    widest and longest of the group and pays for every group it runs (``padded``,
    :func:`padded_groups`, :func:`padded_group_cost`); the paged kernel attends each query
    over its own sequence's keys. ``trees``: the step's draft trees run as a batch of
    their own (the batch-invariant torch attention, :data:`TREE_BATCH_WORK`)."""
    extra = TREE_BATCH_WORK if trees else 0.0
    if not padded:
        return extra + sum(n * (c + n) for c, n in sequences) / 1000
    return extra + sum(padded_group_cost([sequences[i] for i in g]) for g in padded_groups(sequences)) / 1000


class StepShape:
    """A step before drafts (its sequences as ``(cached, new)`` tokens), and the attention
    work it would do with drafts: ``tokens`` in all, ``drafting`` of the one-token
    sequences given drafts (those with the longest contexts), the widest of them verifying
    ``widest`` tokens (each draft token is one more query and one more key of its
    sequence; padded, every drafting sequence is counted that wide), ``trees`` whether
    some of the drafts are trees, which cost a batch of their own where ``tree_batch``
    (the batch-invariant torch attention)."""

    def __init__(self, sequences: list[tuple[int, int]], padded: bool, tree_batch: bool = False):
        self.padded = padded
        self.tree_batch = tree_batch
        self.tokens = sum(n for _, n in sequences)
        self.work = attention_work(sequences, padded) if sequences else 0.0
        self.wide = [(c, n) for c, n in sequences if n > 1]
        self.singles = sorted((c for c, n in sequences if n == 1), reverse=True)
        self.decode_context = 1 + sum(self.singles) / len(self.singles) if self.singles else 0.0  # keys of a decode
        self._padded_work: dict[tuple[int, int], float] = {}

    def work_at(self, tokens: int, widest: int = 1, drafting: int = 0, trees: bool = False) -> float:
        extra = TREE_BATCH_WORK if trees and drafting and self.tree_batch else 0.0
        if not self.padded:
            return extra + self.work + (tokens - self.tokens) * (self.decode_context + 1) / 1000
        if not drafting:
            return self.work
        key = (widest, drafting)
        if key not in self._padded_work:  # the planner asks for the same few shapes many times a step
            singles = [(c, widest if i < drafting else 1) for i, c in enumerate(self.singles)]
            self._padded_work[key] = attention_work(self.wide + singles, True)
        return extra + self._padded_work[key]


@attrs.define
class DraftOption:
    """What drafting ``j`` levels deep would bring one request: ``gains[j - 1]`` expected
    extra tokens from level ``j`` (``P(at least j accepted)``), ``nodes[j]`` the tokens
    the step verifies for it at depth ``j`` (``nodes[0]``: 0)."""

    gains: list[float]
    nodes: list[int]


def best_depths(options: list[DraftOption], base_tokens: int, step_seconds: Callable[[int, int, int], float],
                draft_seconds: Callable[[int], float] = lambda depth: 0.0) -> list[int]:
    """The depth of each option that maximises expected tokens per second of the step.

    ``base_tokens``: the step's target tokens without any draft (every request's root,
    prompt chunks); each request emits one token without drafts.
    ``step_seconds(tokens, widest, drafting)``: the step's time with ``tokens`` target
    tokens, ``drafting`` requests verifying drafts, the widest ``widest`` tokens.
    ``draft_seconds(d)``: drafting time when the deepest request drafts ``d`` levels.
    """
    depths = [0] * len(options)
    tokens, expected, deepest, widest, drafting = base_tokens, float(len(options)), 0, 1, 0
    best_rate, best = expected / step_seconds(tokens, widest, drafting), list(depths)
    heap = []

    def push(i: int) -> None:
        j = depths[i] + 1
        opt = options[i]
        if j < len(opt.nodes) and j <= len(opt.gains):
            heapq.heappush(heap, (-opt.gains[j - 1] / max(opt.nodes[j] - opt.nodes[j - 1], 1), i, j))

    for i in range(len(options)):
        push(i)
    while heap:
        _, i, j = heapq.heappop(heap)
        opt = options[i]
        tokens += opt.nodes[j] - opt.nodes[j - 1]
        expected += opt.gains[j - 1]
        drafting += j == 1
        depths[i] = j
        deepest = max(deepest, j)
        widest = max(widest, 1 + opt.nodes[j])
        rate = expected / (step_seconds(tokens, widest, drafting) + draft_seconds(deepest))
        if rate > best_rate * 1.001:  # a draft must pay, not tie
            best_rate, best = rate, list(depths)
        push(i)
    return best


class _StepLoad:
    """The target tokens of a step as chosen so far (``depths`` of ``options`` over
    ``base_tokens``), to price one more request's draft of ``extra`` tokens."""

    def __init__(self, base_tokens: int, options: list[DraftOption], depths: list[int]):
        self.tokens = base_tokens + sum(opt.nodes[d] for opt, d in zip(options, depths))
        self.widest = max((1 + opt.nodes[d] for opt, d in zip(options, depths) if d), default=1)
        self.drafting = sum(d > 0 for d in depths)

    def extra_seconds(self, step_seconds: Callable[[int, int, int], float], extra: int) -> float:
        now = step_seconds(self.tokens, self.widest, self.drafting)
        return step_seconds(self.tokens + extra, max(self.widest, 1 + extra), self.drafting + 1) - now

    def add(self, extra: int) -> None:
        self.tokens += extra
        self.widest = max(self.widest, 1 + extra)
        self.drafting += 1


@attrs.define
class RequestDraftState:
    """What the planner keeps of one request."""

    stats: AcceptanceStats | None = None  # its own acceptance, leaning on the engine-wide estimate
    steps_without_drafts: int = 0  # decode steps since a draft was last verified
    probe_after: int = 0  # steps without drafts before the next probe (0: the planner's default)
    last_warm_up: int = -1  # serial number of its last aux-only warm-up (the oldest runs first)
    recent_acceptance: deque = attrs.Factory(lambda: deque(maxlen=64))  # accepted share of each recent draft
    paused_until: int = 0  # decode step at which a low-acceptance pause ends


@attrs.frozen
class LowAcceptancePause:
    """A request whose mean accepted share over its last ``window`` drafts falls below
    ``min_rate`` stops drafting for ``retry_after`` steps (``min_acceptance_rate``)."""

    min_rate: float
    window: int
    retry_after: int


class DraftPlanner:
    """Every rule that decides how much a request drafts in a step, and the state they need.

    The fixed rules: the configured shape for the batch size (``draft_len_schedule``), the
    room left in the request and the context, the scheduler's allowance, and the
    low-acceptance pause. With ``adaptive`` on, the depth that maximises the step's
    expected tokens per second (see the module docstring), probes included.

    ``stats`` is the engine-wide acceptance, the prior of every request's own;
    ``costs`` the measured step and drafting costs; ``aux_tokens`` the mean number of aux
    tokens a proposal brings (lookahead's window), which drafting costs in the target
    forward whatever depth is verified.
    """

    def __init__(self, nodes_for_depth: Callable[[int], int], probe_interval: int, probe_share: float = 0.03,
                 chain_or_tree: bool = False, adaptive: bool = True,
                 shape_for_batch: Callable[[int], tuple[int, int]] | None = None,
                 pause: LowAcceptancePause | None = None):
        self.nodes_for_depth = nodes_for_depth
        self.shape_for_batch = shape_for_batch
        self.adaptive = adaptive
        self.pause = pause
        self.chain_or_tree = chain_or_tree
        self.probe_interval = probe_interval
        self.probe_share = probe_share
        self.probe_credit = 0.0  # seconds probes may still spend: a share of every step's estimate
        self.unpaid_probes = 0  # probes and warm-ups since a draft was last kept on its merit
        self.costs = StepCostModel()
        self.stats = AcceptanceStats(decay=0.99, prior_weight=2.0)
        self.aux_tokens = 0.0
        self.requests: dict[str, RequestDraftState] = {}
        self._probing: set[int] = set()  # ids of the requests plan() asked for a probe this step
        self.num_verified = 0  # drafts verified since the engine started
        self.num_warm_ups = 0
        #: how many observations the engine-wide estimate weighs as in a request's own
        #: (:class:`AcceptanceStats`): lower lets a request's own failures count sooner but
        #: makes its estimate noisier (``scripts/ab_planner.py`` varies it).
        self.request_prior_weight = attrs.fields(AcceptanceStats).prior_weight.default

    @classmethod
    def for_config(cls, spec: SpeculativeConfig) -> DraftPlanner:
        """The planner of an engine speculating with ``spec``."""
        pause = (LowAcceptancePause(spec.min_acceptance_rate, spec.acceptance_window, spec.retry_after)
                 if spec.min_acceptance_rate > 0 else None)
        # the config is frozen: its shapes are worked out once per depth and batch size
        return cls(functools.cache(spec.nodes_for_depth), spec.probe_interval, chain_or_tree=spec.chain_or_tree,
                   adaptive=spec.is_adaptive, shape_for_batch=functools.cache(spec.draft_shape_for_batch),
                   pause=pause)

    # -- before drafting ----------------------------------------------------------------

    def draft_budget(self, batch_size: int) -> int:
        """Draft nodes the scheduler keeps room for per decoding request."""
        return self.shape_for_batch(max(batch_size, 1))[1]

    def shapes(self, reqs: list, allowances: list[int], batch_size: int, max_model_len: int,
               shape: StepShape) -> list[tuple[int, int]]:
        """The (depth, nodes) to ask each request's drafter for: the configured shape for
        ``batch_size`` within the scheduler's allowance and the room left in the request
        and the context, none while the request is paused, then, if adaptive, the depth
        that pays (:meth:`plan`)."""
        depth, nodes = self.shape_for_batch(batch_size)
        caps = []
        for req, allowance in zip(reqs, allowances):
            room = min(req.sampling_params.max_tokens - req.num_output_tokens,
                       max_model_len - len(req.token_ids)) - 1
            d = 0 if self._paused(req) else max(0, min(depth, room, allowance))
            caps.append((d, min(nodes, allowance) if d else 0))
        return self.plan(reqs, caps, shape) if self.adaptive else caps

    def _paused(self, req) -> bool:
        return self.pause is not None and req.metrics.num_steps < self.state(req).paused_until

    # -- after drafting and verification --------------------------------------------------

    def observe_drafting(self, depth: int, seconds: float, trees: bool) -> None:
        """A drafting call asked for ``depth`` levels at most and took ``seconds``."""
        if self.adaptive:
            self.costs.observe_draft(depth, seconds, trees)

    def observe_decode(self, req, proposal, accepted_nodes: list[int]) -> None:
        """``req`` decoded a step, verifying ``proposal`` (None: no drafts) of which the
        target accepted ``accepted_nodes``."""
        state = self.state(req)
        depth = proposal.depth if proposal is not None else 0
        state.steps_without_drafts = 0 if depth else state.steps_without_drafts + 1
        if not depth:
            return
        if self.adaptive:
            self.observe_verified(req, proposal, accepted_nodes)
        if self.pause is None:
            return
        state.recent_acceptance.append(len(accepted_nodes) / depth)
        window = self.pause.window
        if len(state.recent_acceptance) >= window:
            if sum(list(state.recent_acceptance)[-window:]) / window < self.pause.min_rate:
                state.paused_until = req.metrics.num_steps + self.pause.retry_after
                state.recent_acceptance.clear()

    def observe_step(self, num_tokens: int, work: float, seconds: float, widest: int) -> None:
        """A step ran (drafting excluded; ``widest``: the most new tokens of one
        decoding sequence, 1 where none verifies drafts): the cost model learns from it, and probes earn
        :attr:`probe_share_now` of its estimated time (estimates, not the clock, so that a noisy
        step neither grants nor denies a probe), saved up to ``probe_share`` of four of the
        longest back-offs at most, so that a long spell without probes is no licence for a
        burst, and the dearest probe is paid in the end however far the share has halved."""
        if not self.adaptive:
            return
        self.costs.observe_step(num_tokens, work, seconds, widest)
        estimate = self.costs.step_seconds(num_tokens, work, widest)
        self.probe_credit = min(self.probe_credit + self.probe_share_now * estimate,
                                self.probe_share * 4 * 8 * self.probe_interval * estimate)

    @property
    def probe_share_now(self) -> float:
        """``probe_share``, halved for each probe or warm-up in a row that led to no draft
        worth verifying (down to an eighth)."""
        return self.probe_share / 2 ** min(self.unpaid_probes, PROBE_SHARE_HALVINGS)

    def _afford_probe(self, seconds: float) -> bool:
        """Pay ``seconds`` of probing from the budget, if it holds them."""
        if seconds > self.probe_credit:
            return False
        self.probe_credit -= max(seconds, 0.0)
        return True

    def _paid_from_budget(self, order: list[int], extra_tokens: Callable[[int], int], load: _StepLoad,
                          step: Callable[[int, int, int], float]) -> list[int]:
        """The candidates in ``order`` whose ``extra_tokens`` the probe budget pays for,
        each added to the step's ``load`` as it is paid."""
        paid = []
        for i in order:
            if self._afford_probe(load.extra_seconds(step, extra_tokens(i))):
                load.add(extra_tokens(i))
                paid.append(i)
        return paid

    def _overdue_first(self, reqs: list, candidates: list[int]) -> list[int]:
        """The requests among ``candidates`` due for a probe, the longest overdue first."""
        due = [i for i in candidates if self._probe_due(reqs[i])]
        states = {i: self.state(reqs[i]) for i in due}
        return sorted(due, key=lambda i: (states[i].probe_after or self.probe_interval)
                      - states[i].steps_without_drafts)

    def state(self, req) -> RequestDraftState:
        """What the planner keeps of ``req`` (made on first use, dropped by :meth:`forget`)."""
        state = self.requests.get(req.request_id)
        if state is None:
            state = self.requests[req.request_id] = RequestDraftState()
        return state

    def forget(self, req) -> None:
        """``req`` ended: drop its state."""
        self.requests.pop(req.request_id, None)

    def request_stats(self, req) -> AcceptanceStats:
        state = self.state(req)
        if state.stats is None:
            state.stats = AcceptanceStats(prior=self.stats, prior_weight=self.request_prior_weight)
        return state.stats

    def _probe_due(self, req) -> bool:
        state = self.state(req)
        return state.steps_without_drafts >= (state.probe_after or self.probe_interval)

    def _probed(self, req) -> None:
        """A probe was forced: the next one waits twice as long (up to 8x), so a request
        whose drafts keep not paying costs ever less; drafts that pay reset the wait."""
        state = self.state(req)
        state.probe_after = min(2 * (state.probe_after or self.probe_interval), 8 * self.probe_interval)
        state.steps_without_drafts = 0
        self.unpaid_probes += 1

    def step_seconds(self, shape: StepShape, trees: bool = False) -> Callable[[int, int, int], float]:
        """The step's estimated seconds by its target tokens, widest sequence and number of
        requests verifying drafts (``trees``: the drafts are trees)."""
        return lambda tokens, widest, drafting: self.costs.step_seconds(
            tokens, shape.work_at(tokens, widest, drafting, trees), widest)

    def plan(self, reqs: list, caps: list[tuple[int, int]], shape: StepShape) -> list[tuple[int, int]]:
        """The (depth, nodes) to ask each request's drafter for, within ``caps`` (depth,
        nodes): the best depth for each request's most promising kind of draft, should the
        drafter propose one, with what asking costs (drafting time, aux tokens) divided by
        the chance that it does; where the drafter may grow a chain in place of its tree
        (``chain_or_tree``), whichever of the two pays more for this request
        (:meth:`_chain_or_tree`). A request due for a probe is asked for one level (a
        chain, where one may be asked for)."""
        candidates, hits = [], []
        self._probing = set()
        for req, (depth, nodes) in zip(reqs, caps):
            stats = self.request_stats(req)
            hit = max(stats.draft_rate(), 0.05)
            hits.append(hit)
            aux = round(self.aux_tokens / hit)
            tree_nodes = [0] + [min(self.nodes_for_depth(j), nodes) + aux for j in range(1, depth + 1)]
            if self.chain_or_tree and tree_nodes[-1] > depth + aux:
                candidates.append([DraftOption(stats.curve(TREE_KIND, depth), tree_nodes),
                                   DraftOption(stats.curve(None, depth), [j + aux for j in range(depth + 1)])])
                continue
            gains = max((stats.curve(kind, depth) for kind in stats.kinds() or {None}), key=sum)
            candidates.append([DraftOption(gains, tree_nodes)])
        mean_hit = sum(hits) / len(hits) if hits else 1.0
        chains = self._chain_or_tree(candidates, shape, mean_hit)
        options = [c[1] if chain else c[0] for c, chain in zip(candidates, chains)]
        trees = any(opt.nodes[j] > j for opt in options for j in range(len(opt.nodes)))
        step = self.step_seconds(shape, trees)
        depths = best_depths(options, shape.tokens, step,
                             functools.partial(self._drafting_seconds, trees=trees, hit=mean_hit))
        load = _StepLoad(shape.tokens, options, depths)
        off = [i for i in range(len(reqs)) if depths[i] == 0 and caps[i][0] > 0]
        drafting_level = self.costs.draft_seconds(1)  # every probe pays its own
        for i in self._overdue_first(reqs, off):
            if not drafting_level and self._probing:  # drafting not timed yet: one probe
                break
            extra = (1 if self.chain_or_tree else min(self.nodes_for_depth(1), caps[i][1])) + round(self.aux_tokens)
            if self._afford_probe(load.extra_seconds(step, extra) + drafting_level):
                load.add(extra)
                depths[i] = 1
                chains[i] = self.chain_or_tree
                self._probed(reqs[i])
                self._probing.add(id(reqs[i]))
        for i in off:
            if depths[i] == 0:
                reqs[i].metrics.num_steps_speculation_off += 1
        return [(d, d if chain else min(self.nodes_for_depth(d), nodes) if d else 0)
                for d, chain, (_, nodes) in zip(depths, chains, caps)]

    def _drafting_seconds(self, depth: int, trees: bool, hit: float) -> float:
        """What asking for ``depth`` levels costs: drafting time over the chance of a draft."""
        return self.costs.draft_seconds(depth, trees) / hit

    def _chain_or_tree(self, candidates: list[list[DraftOption]], shape: StepShape, hit: float) -> list[bool]:
        """For each request, whether its chain (the second of its ``candidates``) pays more
        than its tree (the first), each priced alone in the step, as the only request
        drafting, at the best depth for it. The tree's acceptance is learnt from the trees
        verified (:data:`TREE_KIND`), the chain's from the chains and from the chain inside
        each verified tree (:meth:`observe_verified`): a tree holds more nodes than the chain and
        is chosen while its estimate pays for them; an estimate not yet verified starts at
        the same guess for both, so the tree is tried where the chain does poorly."""
        chains = [False] * len(candidates)
        none = DraftOption([], [0])
        for i, pair in enumerate(candidates):
            if len(pair) < 2:
                continue
            rates = []
            for opt in pair:
                alone = [none] * len(candidates)
                alone[i] = opt
                tree = opt is pair[0]
                step = self.step_seconds(shape, trees=tree)
                drafting = functools.partial(self._drafting_seconds, trees=tree, hit=hit)
                depth = best_depths(alone, shape.tokens, step, drafting)[i]
                tokens = shape.tokens + opt.nodes[depth]
                seconds = step(tokens, 1 + opt.nodes[depth], int(depth > 0)) + drafting(depth)
                rates.append((len(candidates) + sum(opt.gains[:depth])) / seconds)
            chains[i] = rates[1] >= rates[0]
        return chains

    def trim(self, reqs: list, proposals: list, shape: StepShape) -> list:
        """The proposals cut to the depth each is worth verifying (None: none of it), from
        the acceptance of its own kind; a request due for a probe keeps at least one level.
        A proposal of aux tokens only (lookahead filling its n-gram pool) brings no token
        this step: like a probe, it runs where plan() paid for a probe or the probe budget
        holds it, the request that warmed up longest ago first."""
        if not self.adaptive:
            return proposals
        options = []
        for prop in proposals:
            if prop is not None:
                self.aux_tokens += 0.2 * (len(prop.aux_token_ids) - self.aux_tokens)
        for req, prop in zip(reqs, proposals):
            if prop is None or prop.depth == 0:
                options.append(DraftOption([], [0]))
                continue
            node_depths = prop.depths()
            nodes = [0] + [sum(d <= j for d in node_depths) + len(prop.aux_token_ids)
                           for j in range(1, prop.depth + 1)]
            options.append(DraftOption(self.request_stats(req).curve(prop.kind, prop.depth), nodes))
        step = self.step_seconds(shape, trees=any(prop is not None and prop.verified_as_tree for prop in proposals))
        depths = self._one_while_cold(best_depths(options, shape.tokens, step), options)
        load = _StepLoad(shape.tokens, options, depths)
        probing, self._probing = self._probing, set()
        cut = []  # drafts the estimate refuses, not already probes
        warming, warm = [], set()  # aux-only proposals: not already probes; kept
        for i, (req, prop) in enumerate(zip(reqs, proposals)):
            if prop is None:
                continue
            if prop.depth == 0:
                if id(req) in probing:
                    load.add(len(prop.aux_token_ids))
                    warm.add(i)
                else:
                    warming.append(i)
            elif id(req) in probing:  # a probe paid for in plan(), whatever its draft is worth now
                if depths[i] == 0:
                    depths[i] = 1
                    load.add(options[i].nodes[1])
            elif depths[i] > 0:
                self.state(req).probe_after = 0
                self.unpaid_probes = 0
            else:
                cut.append(i)
        for i in self._paid_from_budget(self._overdue_first(reqs, cut), lambda i: options[i].nodes[1], load, step):
            depths[i] = 1
            self._probed(reqs[i])
        for i in self._paid_from_budget(sorted(warming, key=lambda i: self.state(reqs[i]).last_warm_up),
                                        lambda i: len(proposals[i].aux_token_ids), load, step):
            warm.add(i)
            self.state(reqs[i]).last_warm_up = self.num_warm_ups
            self.num_warm_ups += 1
            self.unpaid_probes += 1
        kept = [prop if i in warm else None if prop is None else prop.up_to_depth(depths[i])
                for i, prop in enumerate(proposals)]
        for req, prop, k in zip(reqs, proposals, kept):
            if prop is not None and k is None:
                req.metrics.num_steps_speculation_off += 1
        return kept

    def _one_while_cold(self, depths: list[int], options: list[DraftOption]) -> list[int]:
        """``depths``, but until :data:`COLD_START_DRAFTS` drafts have been verified only the
        request expecting the most verifies its draft: the acceptance of a batch's drafts is
        the initial guess until then, and one request finds out what they bring."""
        if self.num_verified >= COLD_START_DRAFTS or sum(d > 0 for d in depths) < 2:
            return depths
        first = max(range(len(depths)), key=lambda i: sum(options[i].gains[:depths[i]]))
        return [d if i == first else 0 for i, d in enumerate(depths)]

    def observe_asks(self, reqs: list, proposals: list) -> None:
        """Whether each request asked for a draft got one. A proposal of aux tokens only
        (lookahead filling its n-gram pool) is neither: the drafter is warming up."""
        if not self.adaptive:
            return
        for req, prop in zip(reqs, proposals):
            if prop is not None and prop.depth == 0:
                continue
            self.request_stats(req).observe_ask(prop is not None)
            self.stats.observe_ask(prop is not None)

    def observe_verified(self, req, proposal, accepted_nodes: list[int]) -> None:
        """What the target accepted of a verified ``proposal`` (its accepted nodes, root
        first); for a dynamic tree whose drafter may be asked for a chain, also how far its
        chain, the path of first children, would have been accepted, so that the chain's
        estimate is read where the trees run, not only where chains were tried."""
        self.observe(req, proposal.kind, proposal.depth, len(accepted_nodes))
        if self.chain_or_tree and proposal.kind == TREE_KIND:
            chain = first_child_path(proposal.parents)
            kept = next((j for j, (a, c) in enumerate(zip(accepted_nodes, chain)) if a != c),
                        min(len(accepted_nodes), len(chain)))
            self.observe(req, None, len(chain), kept)

    def observe(self, req, kind: Hashable, depth: int, accepted: int) -> None:
        """What the target accepted of a verified draft of ``depth`` levels."""
        self.request_stats(req).observe(kind, depth, accepted)
        self.stats.observe(kind, depth, accepted)
        self.num_verified += 1
