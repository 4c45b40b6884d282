"""The executor: requests, scheduler, model runner and the speculative step."""

from .engine import Engine, StepOutput
from .model_runner import TargetModel
from .request import Request

__all__ = ["Engine", "Request", "StepOutput", "TargetModel"]
