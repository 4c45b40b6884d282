"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum

import attrs
import torch

from ..sampler.grammar import Grammar
from ..sampling_params import SamplingParams
from .metrics import RequestMetrics


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define(eq=False)
class Request:
    """One generation request.

    ``token_ids`` holds the prompt followed by every accepted output token;
    ``num_computed`` tokens of it have their K/V committed in ``block_table``'s blocks.
    While decoding, the last token is not in the cache yet: it is the root of the next
    draft. ``drafter_state`` is a free dict for the drafter's per-request state.
    """

    request_id: str
    token_ids: list[int]
    prompt_len: int
    sampling_params: SamplingParams
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error"): its own input, such as its grammar
    num_computed: int = 0
    num_from_prefix_cache: int = 0  # tokens the current admission took from the prefix cache
    block_table: list[int] = attrs.Factory(list)
    window_from: int = 0  # blocks of block_table before it left the sliding-window layers (KVCacheManager)
    drafter_state: dict = attrs.Factory(dict)
    metrics: RequestMetrics = attrs.Factory(RequestMetrics)
    stop_text: str | None = None  # the output text cut before a stop string that ended it
    output_logprobs: list[dict[int, float]] = attrs.Factory(list)  # per output token, if asked (see SamplingParams)
    prompt_logprobs: list[dict[int, float]] = attrs.Factory(list)  # per prompt token from the second, if asked
    grammar: Grammar | None = None  # the matcher of ``sampling_params.structured_outputs``, at the output's end

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before decoding: the whole prompt for a new request (its last
        logits give the first token); all but the last token for a preempted one."""
        return len(self.token_ids) if self.num_output_tokens == 0 else len(self.token_ids) - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
