"""Medusa heads: registration and options; the method comes in its own issue.

Options: speculative_model (the heads checkpoint), num_medusa_heads, medusa_choices
(the static tree as paths of top-k indices), and the opt-in lossy typical acceptance
(posterior_threshold, posterior_alpha).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range
from specdec.sampler.lossy import TypicalAcceptance


@attrs.frozen(kw_only=True)
class MedusaConfig(SpeculativeConfig):
    speculative_model: str | None = None
    num_medusa_heads: int | None = attrs.field(default=None, validator=in_range(1, 64))
    medusa_choices: list[list[int]] | None = None
    use_typical_acceptance: bool = False
    posterior_threshold: float = attrs.field(default=0.09, validator=in_range(0.0, 1.0))
    posterior_alpha: float = attrs.field(default=0.3, validator=in_range(0.0, 1.0))

    def acceptance_rule(self):
        """Typical acceptance when switched on: faster, but NOT lossless."""
        return TypicalAcceptance(self.posterior_threshold, self.posterior_alpha) if self.use_typical_acceptance \
            else None


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="medusa", aliases=("Medusa",), config_class=MedusaConfig,
                          description="Medusa decoding heads over a static tree (not implemented yet)"))
