"""The executor: requests, scheduler, model runner and the speculative step."""

from ..model.target import TargetModel
from .engine import Engine
from .request import Request
from .step_items import StepOutput

__all__ = ["Engine", "Request", "StepOutput", "TargetModel"]
