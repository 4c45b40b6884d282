"""Probes: how a request kept from drafting finds out whether drafts would pay again.

A request kept from drafting is probed with a one-level draft after ``interval`` steps,
then after twice as long each time the probe does not pay (up to 8x). Probes, and
proposals of aux tokens only (lookahead filling its pool), are paid from a budget shared by
the batch: a share of every step's estimated time that halves after each probe that led to
no paying draft, so that a batch whose drafts never pay loses at most that share.
"""

from __future__ import annotations

from collections.abc import Callable

from .depth_choice import StepLoad

#: probes and warm-ups in a row that led to no draft worth verifying, after which the probe
#: share stops halving (an eighth of it)
PROBE_SHARE_HALVINGS = 3


class ProbeBudget:
    """The seconds probes may still spend (``credit``) and each request's probe schedule
    (its ``steps_without_drafts`` and ``probe_after``, kept in the planner's per-request
    state)."""

    def __init__(self, interval: int, share: float = 0.03):
        self.interval = interval
        self.share = share
        self.credit = 0.0  # seconds probes may still spend: a share of every step's estimate
        self.unpaid = 0  # probes and warm-ups since a draft was last kept on its merit

    @property
    def share_now(self) -> float:
        """``share``, halved for each probe or warm-up in a row that led to no draft worth
        verifying (down to an eighth)."""
        return self.share / 2 ** min(self.unpaid, PROBE_SHARE_HALVINGS)

    def earn(self, estimate: float) -> None:
        """A step estimated at ``estimate`` seconds ran: probes earn :attr:`share_now` of it
        (estimates, not the clock, so that a noisy step neither grants nor denies a probe),
        saved up to ``share`` of four of the longest back-offs at most, so that a long spell
        without probes is no licence for a burst, and the dearest probe is paid in the end
        however far the share has halved."""
        self.credit = min(self.credit + self.share_now * estimate, self.share * 4 * 8 * self.interval * estimate)

    def afford(self, seconds: float) -> bool:
        """Pay ``seconds`` of probing from the budget, if it holds them."""
        if seconds > self.credit:
            return False
        self.credit -= max(seconds, 0.0)
        return True

    def paid_from(self, order: list[int], extra_tokens: Callable[[int], int], load: StepLoad,
                  step: Callable[[int, int, int], float]) -> list[int]:
        """The candidates in ``order`` whose ``extra_tokens`` the budget pays for, each added
        to the step's ``load`` as it is paid."""
        paid = []
        for i in order:
            if self.afford(load.extra_seconds(step, extra_tokens(i))):
                load.add(extra_tokens(i))
                paid.append(i)
        return paid

    def due(self, state) -> bool:
        """Whether a request with this state is due for a probe."""
        return state.steps_without_drafts >= (state.probe_after or self.interval)

    def overdue_first(self, states: dict[int, object]) -> list[int]:
        """The keys of ``states`` due for a probe, the longest overdue first."""
        due = [i for i, state in states.items() if self.due(state)]
        return sorted(due, key=lambda i: (states[i].probe_after or self.interval) - states[i].steps_without_drafts)

    def probed(self, state) -> None:
        """A probe was forced: the next one waits twice as long (up to 8x), so a request
        whose drafts keep not paying costs ever less; drafts that pay reset the wait."""
        state.probe_after = min(2 * (state.probe_after or self.interval), 8 * self.interval)
        state.steps_without_drafts = 0
        self.unpaid += 1

    def warmed_up(self) -> None:
        """An aux-only proposal ran on the budget: it counts as a probe that did not pay."""
        self.unpaid += 1

    def paid_off(self, state) -> None:
        """A request's draft was kept on its merit: its probes are back to the default wait,
        and the share to its whole."""
        state.probe_after = 0
        self.unpaid = 0
