"""What a step and a draft level cost, for the planner's prices.

:class:`StepCostModel` learns both from the clock while serving (no calibration, no table to
tune); :class:`FixedCosts` is a given cost model in its place, for tests and experiments
whose decisions must not depend on the machine's load. The planner takes either as its
``costs``: anything with these four methods prices its steps.
"""

from __future__ import annotations

import math

import attrs


class DecayedLeastSquares:
    """Least squares of ``y`` on a few features, older observations forgotten geometrically
    (``forgetting`` per observation) so that the fit follows a machine that speeds up or
    slows down; :meth:`fit` keeps the best fit with no negative coefficient."""

    #: observations between refits once twice as many were seen: a refit solves up to
    #: eight small systems in Python (about 0.1 ms, 1% of a decode step on a CPU), and a
    #: few observations move a fit that forgets a few percent each by little
    REFIT_EVERY = 4

    def __init__(self, size: int, forgetting: float):
        self.forgetting = forgetting
        self.xtx = [[0.0] * size for _ in range(size)]
        self.xty = [0.0] * size
        self.yty = 0.0
        self.count = 0

    def observe(self, x: tuple[float, ...], y: float) -> None:
        f, n = self.forgetting, len(self.xty)
        for i in range(n):
            self.xty[i] = f * self.xty[i] + x[i] * y
            for j in range(n):
                self.xtx[i][j] = f * self.xtx[i][j] + x[i] * x[j]
        self.yty = f * self.yty + y * y
        self.count += 1

    def refit_due(self) -> bool:
        """Whether a fit made before the last observation should be made again."""
        return self.count < 2 * self.REFIT_EVERY or self.count % self.REFIT_EVERY == 0

    def weight(self) -> float:
        """The decayed number of observations, where the first feature is always 1."""
        return self.xtx[0][0]

    def mean(self, i: int) -> float:
        """The decayed mean of feature ``i``, where the first feature is always 1."""
        return self.xtx[0][i] / self.xtx[0][0]

    def fit(self, subsets: list[tuple[int, ...]]) -> list[float] | None:
        """The coefficients (0 for a feature left out) of the subset of features whose fit
        leaves the least residual with none negative; ties go to the earlier subset."""
        n = len(self.xty)
        best, best_residual = None, math.inf
        for features in subsets:
            beta = _solve([[self.xtx[i][j] + (1e-9 * self.xtx[i][i] if i == j else 0.0) for j in features]
                           for i in features], [self.xty[i] for i in features])
            if beta is None or any(v < 0 for v in beta):
                continue
            full = [0.0] * n
            for i, v in zip(features, beta):
                full[i] = v
            residual = self.yty - 2 * sum(full[i] * self.xty[i] for i in range(n)) + sum(
                full[i] * self.xtx[i][j] * full[j] for i in range(n) for j in range(n))
            if residual < best_residual - 1e-15:
                best, best_residual = full, residual
        return best


class StepCostModel:
    """Seconds of a step, ``a + d * [widest > 1] + b * tokens + c * work``, and of drafting.

``tokens`` is the number of target tokens in the step's forward (weights are streamed
once per step, each token adds matmul rows); ``work`` the attention it does in thousands
of query-key pairs, which grows with the batch's contexts. ``d`` is the jump from a step
where every decoding sequence has one new token to one where some sequence (``widest``)
verifies drafts: a compiled target runs one token through a graph of its own, so the first
draft token can cost more than each later one. Prompt chunks do not count as wide (their
cost is in ``tokens`` and ``work``). The jump is fitted only while both kinds of step have
been seen recently.

A drafting call costs ``e + f * levels + g * caught_up``: ``caught_up`` is the tokens its
requests gained since they last drafted, which a drafter reading the target's states runs
through its own layers before the first level. Priced apart, the catch-up after a pause
(a new request's prompt, the tokens decoded while drafts did not pay) does not make every
level look dear, which would keep drafts off where they pay.

Both fits are least squares over every call seen (:class:`DecayedLeastSquares`). The
drafting fit is guarded against a stall, since it learns only from the drafts the planner
asks for: a call priced so dear that drafts stop is never measured again. The first
``draft_warm_up`` calls of each kind are not observed (a process's first calls can take
hundreds of times longer than the next), drafting is priced only once ``min_draft_calls``
were observed (until then it is untimed, as before any call), and a call no larger than
those seen (levels, tokens caught up) counts as at most :data:`STALL_FACTOR` times its
estimate, while one :data:`STALL_FACTOR` times below it starts the fit again from it: a
paused process inflates one call, not the next, and a machine that really slows down is
followed within a few calls.
"""

    #: decayed number of one-token and of wider steps both needed before the jump is fitted
    MIN_STEPS_OF_EACH = 2.0
    #: the most a drafting call within the sizes already seen counts, in times its estimate
    STALL_FACTOR = 4.0

    def __init__(self, forgetting: float = 0.98, draft_forgetting: float = 0.95, draft_warm_up: int = 2,
                 min_draft_calls: int = 3):
        self.steps = DecayedLeastSquares(4, forgetting)
        self._coefficients: tuple[float, float, float, float] | None = None
        self.draft_forgetting = draft_forgetting
        self.drafts = {trees: DecayedLeastSquares(3, draft_forgetting) for trees in (False, True)}  # chains, trees
        self._draft_coefficients: dict[bool, list[float]] = {}
        self.draft_warm_up = draft_warm_up
        self.min_draft_calls = min_draft_calls
        self._draft_calls = {False: 0, True: 0}
        self._largest_draft = {False: (0, 0), True: (0, 0)}  # (levels, tokens caught up) in the fit, by kind

    @property
    def num_steps(self) -> int:
        return self.steps.count

    def observe_step(self, num_tokens: int, work: float, seconds: float, widest: int | None = None) -> None:
        """A step of ``num_tokens`` target tokens, ``widest`` of them in one sequence
        (None: a single sequence), took ``seconds``."""
        if num_tokens < 1 or seconds <= 0:
            return
        self.steps.observe(self._features(num_tokens, work, widest), seconds)
        if self.steps.refit_due():
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
        fit = self.steps
        if fit.count < 3 or self._token_spread() < 1.0:
            mean = fit.xty[0] / fit.weight() if fit.count else 1.0
            return mean, 0.0, mean / 256, 0.0
        wide = fit.xtx[1][1]
        jump = min(wide, fit.weight() - wide) >= self.MIN_STEPS_OF_EACH
        subsets = [(0,), (0, 2), (0, 3), (0, 2, 3)]
        if jump:
            subsets += [(0, 1, *rest[1:]) for rest in subsets]
        best = fit.fit(subsets)
        self._coefficients = tuple(best) if best is not None else (fit.xty[0] / fit.weight(), 0.0, 0.0, 0.0)
        return self._coefficients

    def _token_spread(self) -> float:
        """Standard deviation of the tokens of the steps seen (decayed weights)."""
        fit = self.steps
        return math.sqrt(max(fit.xtx[2][2] / fit.weight() - fit.mean(2) ** 2, 0.0))

    def step_seconds(self, num_tokens: int, work: float = 0.0, widest: int | None = None) -> float:
        return sum(c * x for c, x in zip(self.coefficients(), self._features(num_tokens, work, widest)))

    def observe_draft(self, depth: int, seconds: float, trees: bool = False, caught_up: int = 0) -> None:
        """A drafting call that asked for ``depth`` levels at most and caught up on
        ``caught_up`` tokens took ``seconds`` (``trees``: some request was asked for more
        nodes than levels). Chains and trees are timed apart: a dynamic tree's level drafts
        several rows and ranks them."""
        if depth < 1:
            return
        self._draft_calls[trees] += 1
        if self._draft_calls[trees] <= self.draft_warm_up:
            return
        levels, tokens = self._largest_draft[trees]
        fit = self._draft_fit(trees) if depth <= levels and caught_up <= tokens else None
        if fit is not None:
            e, f, g = fit
            estimate = e + f * depth + g * caught_up
            if seconds * self.STALL_FACTOR < estimate:  # the fit holds a stall: start it again
                self.drafts[trees] = DecayedLeastSquares(3, self.draft_forgetting)
                levels = tokens = 0
            seconds = min(seconds, self.STALL_FACTOR * estimate)
        self._largest_draft[trees] = (max(levels, depth), max(tokens, caught_up))
        self.drafts[trees].observe((1.0, float(depth), float(caught_up)), seconds)
        if self.drafts[trees].refit_due():
            self._draft_coefficients.pop(trees, None)

    def _draft_fit(self, trees: bool) -> list[float] | None:
        """(e, f, g) of the drafting calls of a kind, None before any: a cost per level
        alone (the calls so far all asked for one depth) unless a fixed cost per call or
        per token caught up fits them better."""
        if trees not in self._draft_coefficients:
            fit = self.drafts[trees]
            self._draft_coefficients[trees] = fit.fit([(1,), (1, 2), (0, 1), (0, 1, 2)]) if fit.count else None
        return self._draft_coefficients[trees]

    def draft_seconds(self, depth: int, trees: bool = False, caught_up: float = 0.0) -> float:
        """Drafting time of ``depth`` levels after ``caught_up`` new tokens (0 while
        untimed); a kind not timed yet is priced as the other."""
        kind = trees if self.drafts[trees].count >= self.min_draft_calls else not trees
        coefficients = self._draft_fit(kind) if self.drafts[kind].count >= self.min_draft_calls else None
        if coefficients is None or depth < 1:
            return 0.0
        e, f, g = coefficients
        return e + f * depth + g * caught_up


@attrs.define
class FixedCosts:
    """A given cost model: ``step + per_token * tokens`` seconds a step, ``per_level`` a
    drafted level and ``per_caught_up`` a token the drafter catches up on, whatever the
    clock says. The defaults are a CPU's shape: weights streamed once per step, extra rows
    nearly free."""

    step: float = 0.03
    per_token: float = 5e-4
    per_level: float = 2e-3
    per_caught_up: float = 0.0

    def observe_step(self, num_tokens: int, work: float, seconds: float, widest: int | None = None) -> None:
        """Measured steps change nothing."""

    def observe_draft(self, depth: int, seconds: float, trees: bool = False, caught_up: int = 0) -> None:
        """Measured drafting changes nothing."""

    def step_seconds(self, num_tokens: int, work: float = 0.0, widest: int | None = None) -> float:
        return self.step + self.per_token * num_tokens

    def draft_seconds(self, depth: int, trees: bool = False, caught_up: float = 0.0) -> float:
        return self.per_level * depth + self.per_caught_up * caught_up


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
