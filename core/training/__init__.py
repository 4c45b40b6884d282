"""Training drafters for a target: ``specdec train`` (see :mod:`specdec.training.loop`)."""

from .data import Sample, TrainingDataError, draft_vocabulary
from .loop import TrainError, TrainOptions, train
from .method import MethodTrainer, TrainBatch, TrainTarget

__all__ = ["MethodTrainer", "Sample", "TrainBatch", "TrainError", "TrainOptions", "TrainTarget",
           "TrainingDataError", "draft_vocabulary", "train"]
