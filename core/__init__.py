"""specdec: lossless speculative decoding for transformers models, every method a plugin."""

from .api import LLM, CompletionOutput, RequestOutput
from .drafting import Drafter, DraftProposal, StepResult, TreeMask
from .hookspecs import hookimpl
from .plugins import DecodingType
from .sampling_params import SamplingParams
from .target_model import TargetModel, TargetParts

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "DecodingType", "DraftProposal", "Drafter", "RequestOutput", "SamplingParams",
           "StepResult", "TargetModel", "TargetParts", "TreeMask", "hookimpl"]
