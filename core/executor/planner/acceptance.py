"""How often drafts are accepted: decayed counts per proposal kind and draft position.

A request's estimate leans on the engine-wide one until it has evidence of its own, so
that a new request starts where the engine's traffic stands and then follows its own text
(a request that copies its prompt accepts far more than one that does not).

The planner reads the curve of every kind for every request each step (eight match lengths
times a batch of eight: 64 curves a step): each estimate keeps the curves it worked out
until it or its prior observes again, so a step works each out once.
"""

from __future__ import annotations

from collections.abc import Hashable

import attrs


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
    version: int = attrs.field(default=0, init=False)  # drafts observed: what a memo of rates was worked out at
    _memo: dict = attrs.field(factory=dict, init=False, repr=False, eq=False)  # (what, kind, depth) -> rates, curve
    _memo_prior: int = attrs.field(default=-1, init=False, repr=False, eq=False)  # the prior's version it holds

    def set_prior_weight(self, weight: float) -> None:
        """Lean on the prior with the weight of ``weight`` observations from now on."""
        self.prior_weight = weight
        self._memo.clear()

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
        self.version += 1
        self._memo.clear()
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
        (a longer ngram match, say) is not refused on the initial guess alone. The list is
        shared with later calls until the next observation: read it, do not change it."""
        return self._memoized("rates", kind, depth, self._rates)

    def _memoized(self, what: str, kind: Hashable, depth: int, work) -> list[float]:
        prior = self.prior.version if self.prior is not None else 0
        if prior != self._memo_prior:
            self._memo.clear()
            self._memo_prior = prior
        key = (what, kind, depth)
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = work(kind, depth)
        return out

    def _rates(self, kind: Hashable, depth: int) -> list[float]:
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
        """``P(at least j positions accepted)`` for ``j = 1..depth`` (shared as :meth:`rates`)."""
        return self._memoized("curve", kind, depth, self._curve)

    def _curve(self, kind: Hashable, depth: int) -> list[float]:
        out, p = [], 1.0
        for rate in self.rates(kind, depth):
            p *= rate
            out.append(p)
        return out

    def kinds(self) -> set:
        mine = set(self.counts)
        return mine | self.prior.kinds() if self.prior is not None else mine


@attrs.define
class AcceptanceSpread:
    """How far requests' first-position acceptance really differs, and so how far a
    request's own estimate should lean on the engine-wide one.

    Each request's drafts are counted in blocks of ``block`` in a row; a finished block's
    accepted share enters decayed moments (``forgetting`` per block). Were every request
    accepting at the engine's rate ``p``, the shares would vary by chance alone,
    ``p (1 - p) / block``; what they vary beyond that, ``tau^2``, is how much requests (or
    stretches of one) truly differ. A beta prior with that spread has the weight of
    ``p (1 - p) / tau^2 - 1`` observations (the method of moments): a trained drafter on
    open-ended text, whose requests differ little, earns a heavy prior, so that a few
    rejected drafts do not hold a request off; requests that differ keep a light one and
    follow their own drafts. :meth:`prior_weight` is that weight within ``[low, high]``,
    ``low`` until ``min_blocks`` blocks were seen. The planner feeds it only drafts of no
    kind of their own (:meth:`DraftPlanner.observe_verified`)."""

    block: int = 8
    forgetting: float = 0.98
    low: float = 3.0
    high: float = 50.0
    min_blocks: float = 4.0
    moments: list[float] = attrs.Factory(lambda: [0.0, 0.0, 0.0])  # decayed blocks, sum of shares, of squares

    def observe(self, pending: list[int], accepted: bool) -> bool:
        """One more draft of a request whose unfinished block is ``pending`` ([drafts,
        first positions accepted], updated here), its first position ``accepted`` or not.
        Returns whether it finished the block (:meth:`prior_weight` may have moved)."""
        pending[0] += 1
        pending[1] += int(accepted)
        if pending[0] < self.block:
            return False
        share = pending[1] / self.block
        pending[0] = pending[1] = 0
        m, f = self.moments, self.forgetting
        m[0], m[1], m[2] = f * m[0] + 1.0, f * m[1] + share, f * m[2] + share * share
        return True

    def prior_weight(self) -> float:
        """The weight of observations a request's estimate gives the engine-wide one."""
        blocks, total, squares = self.moments
        if blocks < self.min_blocks:
            return self.low
        p = total / blocks
        chance = p * (1.0 - p)
        beyond = squares / blocks - p * p - chance / self.block
        if beyond <= chance / (self.high + 1.0):
            return self.high
        return min(max(chance / beyond - 1.0, self.low), self.high)


@attrs.define
class AcceptanceCalibration:
    """How often the target reaches each draft position of the drafts the planner verifies,
    against how often the planner expected it to, and the factors that scale its
    expectations to match.

    The planner verifies a draft where its estimate says the draft pays, so the drafts it
    verifies are more often those whose estimates erred high than low (the winner's curse:
    the noisier the estimates, as a request's own few drafts of a kind are, the more); at a
    batch of several sequences, where an extra row costs nearly what a token earns, the
    drafts its optimism admits cost more than they bring. For each position ``j``,
    :meth:`factor` is the decayed count of verified drafts accepted to ``j`` or further
    over the decayed sum of their expected ``P(at least j accepted)`` (``forgetting`` per
    draft), within ``[low, high]``; 1 until ``min_expected`` was expected at the position.
    ``high`` is 1: an estimate found too low is left as it is (the initial guess of a kind
    never verified is meant to let drafts be tried)."""

    forgetting: float = 0.99
    low: float = 0.5
    high: float = 1.0
    min_expected: float = 4.0
    expected: list[float] = attrs.Factory(list)
    reached: list[float] = attrs.Factory(list)

    def observe(self, gains: list[float], accepted: int) -> None:
        """A verified draft of ``len(gains)`` levels, whose expected ``P(at least j
        accepted)`` were ``gains``, had ``accepted`` levels accepted."""
        f = self.forgetting
        while len(self.expected) < len(gains):
            self.expected.append(0.0)
            self.reached.append(0.0)
        for j in range(len(self.expected)):
            self.expected[j] *= f
            self.reached[j] *= f
        for j, g in enumerate(gains):
            self.expected[j] += g
            self.reached[j] += float(accepted > j)

    def factor(self, position: int) -> float:
        if position >= len(self.expected) or self.expected[position] < max(self.min_expected, 1e-9):
            return 1.0
        return min(max(self.reached[position] / self.expected[position], self.low), self.high)

    def apply(self, gains: list[float]) -> list[float]:
        """``gains`` (``P(at least j accepted)``) scaled position by position, a new list."""
        return [min(g * self.factor(j), 1.0) for j, g in enumerate(gains)]
