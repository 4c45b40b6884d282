"""EAGLE-1/2 and EAGLE-3: registration and options; the methods come in their own issue.

Options: speculative_model (the draft head checkpoint), eagle_choices (a static tree), or a
dynamic tree (use_dynamic_tree, dynamic_tree_max_topk); EAGLE-3 also names the target
layers whose hidden states feed the head (eagle3_layers_to_capture).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range


@attrs.frozen(kw_only=True)
class EagleConfig(SpeculativeConfig):
    speculative_model: str | None = None
    eagle_choices: list[list[int]] | None = None
    use_dynamic_tree: bool = False
    dynamic_tree_max_topk: int = attrs.field(default=8, validator=in_range(1, 64))


@attrs.frozen(kw_only=True)
class Eagle3Config(EagleConfig):
    eagle3_layers_to_capture: list[int] | None = None


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="eagle", aliases=("Eagle",), config_class=EagleConfig,
                          description="EAGLE-1/2 feature-level draft head (not implemented yet)"))
    register(DecodingType(name="eagle3", aliases=("Eagle3",), config_class=Eagle3Config,
                          description="EAGLE-3 multi-layer-feature draft head (not implemented yet)"))
