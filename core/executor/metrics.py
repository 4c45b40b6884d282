"""A request's speculative-decoding metrics: its steps, drafts proposed and accepted, timings."""

from __future__ import annotations

import attrs


@attrs.define
class RequestMetrics:
    """Counters of one request.

    ``num_steps`` counts target forwards while decoding (after the prompt);
    ``draft_len_counts[d]`` the steps that verified a draft of depth ``d`` (0: none);
    ``num_steps_speculation_off`` the steps the adaptive planner chose not to draft for
    the request because drafts would not pay;
    ``num_drafter_faults`` the steps whose drafts were dropped because the drafter failed
    (raised, or proposed something invalid); ``grammar_time`` the seconds spent on
    structured output's token masks (pruning drafts and masking rows); ``lossless`` is
    False once an opt-in lossy acceptance rule verified a draft of the request;
    ``acceptance_length`` is the mean number of tokens each such step emitted, the
    bonus token included; ``per_position_acceptance[k]`` is the rate at which draft
    position ``k + 1`` was accepted when it was proposed.
    """

    num_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_decode_tokens: int = 0
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    drafted_at: list[int] = attrs.Factory(list)
    draft_len_counts: list[int] = attrs.Factory(list)
    num_steps_speculation_off: int = 0
    accepted_at: list[int] = attrs.Factory(list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finish_time: float | None = None
    draft_time: float = 0.0
    grammar_time: float = 0.0
    num_drafter_faults: int = 0
    lossless: bool = True

    def record_step(self, depth_proposed: int, num_draft_tokens: int, num_accepted: int, num_emitted: int) -> None:
        self.num_steps += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self.num_decode_tokens += num_emitted
        while len(self.draft_len_counts) <= depth_proposed:
            self.draft_len_counts.append(0)
        self.draft_len_counts[depth_proposed] += 1
        while len(self.drafted_at) < depth_proposed:
            self.drafted_at.append(0)
            self.accepted_at.append(0)
        for k in range(depth_proposed):
            self.drafted_at[k] += 1
            if k < num_accepted:
                self.accepted_at[k] += 1

    @property
    def acceptance_length(self) -> float:
        return self.num_decode_tokens / self.num_steps if self.num_steps else 0.0

    @property
    def mean_draft_len(self) -> float:
        """Mean depth of the drafts verified per step, steps without drafts included."""
        return sum(d * n for d, n in enumerate(self.draft_len_counts)) / self.num_steps if self.num_steps else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    def merge(self, other: RequestMetrics) -> None:
        for name in ("num_steps", "num_draft_tokens", "num_accepted_tokens", "num_decode_tokens",
                     "num_prompt_tokens", "num_cached_prompt_tokens", "draft_time", "grammar_time",
                     "num_drafter_faults", "num_steps_speculation_off"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.lossless = self.lossless and other.lossless
        for k in range(len(other.drafted_at)):
            if k >= len(self.drafted_at):
                self.drafted_at.append(0)
                self.accepted_at.append(0)
            self.drafted_at[k] += other.drafted_at[k]
            self.accepted_at[k] += other.accepted_at[k]
        for d, n in enumerate(other.draft_len_counts):
            if d >= len(self.draft_len_counts):
                self.draft_len_counts.append(0)
            self.draft_len_counts[d] += n

    def as_dict(self) -> dict:
        return {"num_steps": self.num_steps, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_length": self.acceptance_length,
                "per_position_acceptance": self.per_position_acceptance,
                "mean_draft_len": self.mean_draft_len, "draft_len_counts": self.draft_len_counts,
                "num_steps_speculation_off": self.num_steps_speculation_off,
                "num_prompt_tokens": self.num_prompt_tokens, "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
                "time_to_first_token": self.time_to_first_token, "num_drafter_faults": self.num_drafter_faults,
                "grammar_time": self.grammar_time,
                "lossless": self.lossless}
