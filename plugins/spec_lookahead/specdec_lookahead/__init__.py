"""Lookahead (Jacobi) decoding: registration and options; the method comes in its own issue.

Options (TensorRT-LLM's names): max_window_size (W), max_ngram_size (N),
max_verification_set_size (G).
"""

from __future__ import annotations

import attrs

from specdec import DecodingType, hookimpl
from specdec.config import SpeculativeConfig, in_range


@attrs.frozen(kw_only=True)
class LookaheadConfig(SpeculativeConfig):
    max_window_size: int = attrs.field(default=4, validator=in_range(1, 64))
    max_ngram_size: int = attrs.field(default=3, validator=in_range(2, 16))
    max_verification_set_size: int = attrs.field(default=4, validator=in_range(1, 64))


@hookimpl
def register_decoding_types(register):
    register(DecodingType(name="lookahead", aliases=("Lookahead",), config_class=LookaheadConfig,
                          description="lookahead decoding: Jacobi window and n-gram pool (not implemented yet)"))
