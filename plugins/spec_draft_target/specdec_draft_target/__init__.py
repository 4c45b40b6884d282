"""Draft-target speculation: registration and options; the method comes in its own issue.

Options: speculative_model (a second model with the target's vocabulary), or
draft_layers (a layer-skip draft from the target's first N layers, the default when no
speculative_model is given).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range


@attrs.frozen(kw_only=True)
class DraftTargetConfig(SpeculativeConfig):
    speculative_model: str | None = None
    draft_layers: int | None = attrs.field(default=None, validator=in_range(1, None))


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="draft_target", aliases=("DraftTarget",), config_class=DraftTargetConfig,
                          description="a smaller draft model or a layer-skip self-draft (not implemented yet)"))
