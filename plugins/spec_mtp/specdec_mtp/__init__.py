"""DeepSeek-style multi-token prediction: registration and options; the method comes in its own issue.

Options: num_nextn_predict_layers, and the opt-in lossy relaxed acceptance
(use_relaxed_acceptance_for_thinking, relaxed_topk, relaxed_delta, switched by the
thinking-phase begin/end tokens).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range
from specdec.sampler.lossy import RelaxedAcceptance


@attrs.frozen(kw_only=True)
class MTPConfig(SpeculativeConfig):
    num_nextn_predict_layers: int = attrs.field(default=1, validator=in_range(1, 16))
    use_relaxed_acceptance_for_thinking: bool = False
    relaxed_topk: int = attrs.field(default=1, validator=in_range(1, 64))
    relaxed_delta: float = attrs.field(default=0.0, validator=in_range(0.0, 1.0))
    begin_thinking_phase_token: int | None = None
    end_thinking_phase_token: int | None = None

    def acceptance_rule(self):
        """Relaxed acceptance in thinking phases when switched on: NOT lossless there."""
        if not self.use_relaxed_acceptance_for_thinking:
            return None
        return RelaxedAcceptance(self.relaxed_topk, self.relaxed_delta, self.begin_thinking_phase_token,
                                 self.end_thinking_phase_token)


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="mtp", aliases=("MTP",), config_class=MTPConfig,
                          description="multi-token prediction modules (not implemented yet)"))
