"""Tensor parallelism: the target sharded over ranks of a torch.distributed group.

Rank 0 runs the engine (scheduling, drafting, acceptance) over its shard; the workers hold
theirs and run each target operation rank 0 sends. See the documentation's design page.
"""

from .group import TensorParallelGroup, WorkerError, launched_by_torchrun, threads_per_rank
from .leader import ShardedTarget
from .sharding import check_divides, shard_model
from .worker import run as run_worker

__all__ = ["ShardedTarget", "TensorParallelGroup", "WorkerError", "check_divides", "launched_by_torchrun",
           "run_worker", "shard_model", "threads_per_rank"]
