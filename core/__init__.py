"""specdec: lossless speculative decoding for transformers models, every method a plugin.

The public names load their modules when first used (PEP 562): a worker rank, a
configuration check or ``specdec --help`` imports what it runs, not the engine, the
sampler and llguidance with it; with torch and transformers, importing is most of a
short-lived process's start."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import _moved

__version__ = "0.1.0"

#: each public name -> the module that defines it
_EXPORTS = {
    "LLM": "api", "CompletionOutput": "api", "RequestOutput": "api",
    "hookimpl": "drafting.hookspecs",
    "Drafter": "drafting.interface", "DraftProposal": "drafting.interface", "StepResult": "drafting.interface",
    "TreeMask": "drafting.interface",
    "TargetModel": "model.target", "TargetParts": "model.target",
    "DecodingType": "plugins",
    "SamplingParams": "sampling_params",
}

if TYPE_CHECKING:
    from .api import LLM, CompletionOutput, RequestOutput
    from .drafting.hookspecs import hookimpl
    from .drafting.interface import Drafter, DraftProposal, StepResult, TreeMask
    from .model.target import TargetModel, TargetParts
    from .plugins import DecodingType
    from .sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'specdec' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(f".{module}", __name__), name)
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


_moved.install()

__all__ = ["LLM", "CompletionOutput", "DecodingType", "DraftProposal", "Drafter", "RequestOutput", "SamplingParams",
           "StepResult", "TargetModel", "TargetParts", "TreeMask", "hookimpl"]
