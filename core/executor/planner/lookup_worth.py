"""Whether asking a method's lookup drafter (``speculative_config.lookup``) pays this step.

The lookup is asked for every decoding request, before the method, and what that costs is
Python per request: the lookup's own walk (a suffix trie's: tens of microseconds) and the
planner's pricing of its draft against the method's. Beside a lone request's step that is
little; in a batch on text that seldom repeats (open-ended prompts at batch 8, where each
of the batch's tokens costs a step's time over eight and the lookup's drafts are seldom
verified) it costs more than its drafts bring. So the planner weighs, decayed over the
steps it asked, the tokens accepted from the lookup's drafts per request asked, each worth
the step's seconds per token, against the seconds asking and pricing took per request;
where they do not pay, the lookup is asked one step in :data:`LOOKUP_PROBE_INTERVAL`, which
keeps the estimate current.
"""

from __future__ import annotations

import attrs

#: steps between asks of a lookup that does not pay (the asks that keep its worth current)
LOOKUP_PROBE_INTERVAL = 8


@attrs.define
class LookupWorth:
    """Decayed tokens accepted from the lookup's drafts and seconds spent on it, per request
    asked. ``tokens`` starts at one: a lookup is asked until it proves idle."""

    decay: float = 0.9
    tokens: float = 1.0
    seconds: float = 0.0
    steps_since_ask: int = 0
    asked: int = 0  # requests asked this step

    def observe_ask(self, requests: int, seconds: float) -> None:
        """The lookup was asked for ``requests`` requests, which took ``seconds`` with the
        pricing of its drafts."""
        self.asked = requests
        self.steps_since_ask = 0
        self.seconds += (1 - self.decay) * (seconds / requests - self.seconds)

    def observe_step(self, accepted: int) -> None:
        """The step ran; ``accepted`` tokens of the lookup's drafts were accepted."""
        if self.asked:
            self.tokens += (1 - self.decay) * (accepted / self.asked - self.tokens)
        else:
            self.steps_since_ask += 1
        self.asked = 0

    def worth_asking(self, seconds_per_token: float) -> bool:
        """Whether to ask this step, a token of the batch worth ``seconds_per_token``."""
        return (self.tokens * seconds_per_token >= self.seconds
                or self.steps_since_ask + 1 >= LOOKUP_PROBE_INTERVAL)
