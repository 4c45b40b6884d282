"""Adaptive draft lengths, in parts: the step-cost model, acceptance statistics, the choice
of depths, the probe budget, what asking a lookup drafter is worth, and the planner that
applies them each step."""

from .acceptance import AcceptanceCalibration, AcceptanceSpread, AcceptanceStats
from .cost_model import FixedCosts, StepCostModel
from .depth_choice import TREE_BATCH_WORK, DraftOption, StepLoad, StepShape, attention_work, best_depths
from .planner import COLD_START_DRAFTS, REST_STEPS, DraftPlanner, LowAcceptancePause, RequestDraftState
from .probe_budget import PROBE_SHARE_HALVINGS, ProbeBudget

__all__ = ["AcceptanceCalibration", "AcceptanceSpread", "AcceptanceStats", "COLD_START_DRAFTS", "DraftOption",
           "DraftPlanner", "FixedCosts", "LowAcceptancePause", "PROBE_SHARE_HALVINGS", "ProbeBudget", "REST_STEPS",
           "RequestDraftState", "StepCostModel", "StepLoad", "StepShape", "TREE_BATCH_WORK", "attention_work",
           "best_depths"]
