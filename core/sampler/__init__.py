"""The acceptance sampler: logits processing and lossless verification of chains and trees."""

from .acceptance import Verdict, verify_greedy, verify_greedy_batch, verify_sampled
from .logits import apply_repetition_penalty, pick_draft_token, probs_from_logits

__all__ = ["Verdict", "apply_repetition_penalty", "pick_draft_token", "probs_from_logits", "verify_greedy",
           "verify_greedy_batch", "verify_sampled"]
