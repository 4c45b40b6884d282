"""ReDrafter: registration and options; the method comes in its own issue.

Options: speculative_model (the recurrent draft head), num_beams (beams searched by the
head; their shared prefixes form the verification tree).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range


@attrs.frozen(kw_only=True)
class ReDrafterConfig(SpeculativeConfig):
    speculative_model: str | None = None
    num_beams: int = attrs.field(default=4, validator=in_range(1, 64))


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="redrafter", aliases=("ReDrafter",), config_class=ReDrafterConfig,
                          description="recurrent draft head with beam search (not implemented yet)"))
