"""specdec: lossless speculative decoding for transformers models, every method a plugin."""

from . import _moved
from .api import LLM, CompletionOutput, RequestOutput
from .drafting.hookspecs import hookimpl
from .drafting.interface import Drafter, DraftProposal, StepResult, TreeMask
from .model.target import TargetModel, TargetParts
from .plugins import DecodingType
from .sampling_params import SamplingParams

__version__ = "0.1.0"

_moved.install()

__all__ = ["LLM", "CompletionOutput", "DecodingType", "DraftProposal", "Drafter", "RequestOutput", "SamplingParams",
           "StepResult", "TargetModel", "TargetParts", "TreeMask", "hookimpl"]
