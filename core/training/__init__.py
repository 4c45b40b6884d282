"""Training drafters for a target: ``specdec train`` (see :mod:`specdec.training.loop`)."""

from .data import Sample, TrainingDataError, draft_vocabulary
from .loop import TrainError, TrainOptions, train
from .method import MethodTrainer, TrainBatch, TrainTarget
from .unrolled import UNROLLED_ATTENTION, shift, training_time_test, unrolled_attention

__all__ = ["MethodTrainer", "Sample", "TrainBatch", "TrainError", "TrainOptions", "TrainTarget",
           "TrainingDataError", "UNROLLED_ATTENTION", "draft_vocabulary", "shift", "train",
           "training_time_test", "unrolled_attention"]
