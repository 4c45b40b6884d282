"""The acceptance sampler: logits processing and lossless verification of chains and trees."""

from .acceptance import Verdict, verify_greedy, verify_greedy_batch, verify_sampled, verify_seeded
from .logits import TargetRows, nucleus_floor, pick_draft_token, probs_from_logits, shape_logits

__all__ = ["TargetRows", "Verdict", "nucleus_floor", "pick_draft_token", "probs_from_logits", "shape_logits",
           "verify_greedy", "verify_greedy_batch", "verify_sampled", "verify_seeded"]
