"""The executor: requests, the scheduler, the engine and its step's stages, the draft planner."""

from ..model.target import TargetModel
from .engine import Engine
from .request import Request
from .step_items import StepOutput

__all__ = ["Engine", "Request", "StepOutput", "TargetModel"]
