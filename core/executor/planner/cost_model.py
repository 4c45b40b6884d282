"""What a step and a draft level cost, for the planner's prices.

:class:`StepCostModel` learns both from the clock while serving (no calibration, no table to
tune); :class:`FixedCosts` is a given cost model in its place, for tests and experiments
whose decisions must not depend on the machine's load. The planner takes either as its
``costs``: anything with these four methods prices its steps.
"""

from __future__ import annotations

import math

import attrs


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
class FixedCosts:
    """A given cost model: ``step + per_token * tokens`` seconds a step, ``per_level`` a
    drafted level, whatever the clock says. The defaults are a CPU's shape: weights streamed
    once per step, extra rows nearly free."""

    step: float = 0.03
    per_token: float = 5e-4
    per_level: float = 2e-3

    def observe_step(self, num_tokens: int, work: float, seconds: float, widest: int | None = None) -> None:
        """Measured steps change nothing."""

    def observe_draft(self, depth: int, seconds: float, trees: bool = False) -> None:
        """Measured drafting changes nothing."""

    def step_seconds(self, num_tokens: int, work: float = 0.0, widest: int | None = None) -> float:
        return self.step + self.per_token * num_tokens

    def draft_seconds(self, depth: int, trees: bool = False) -> float:
        return self.per_level * depth
