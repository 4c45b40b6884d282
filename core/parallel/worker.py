"""A worker rank: it holds a shard of the target and of the KV cache, and runs what rank 0
sends (:mod:`.messages`) until rank 0 says stop or is gone.

Started by rank 0 (:mod:`.launch`; the configuration in the file named by
``SPECDEC_TP_CONFIG``), or inside ``LLM()`` on a rank other than 0 under torchrun.
"""

from __future__ import annotations

import json
import logging
import os

import torch

from ..kvcache import PagedKVCache
from ..kvcache.layout import AttentionLayout
from ..model.loading import load_weights, model_display_name, resolve_device, resolve_dtype
from ..model.target import ForwardMetadata, TargetModel
from .group import CONFIG_ENV, TensorParallelGroup, threads_per_rank
from .messages import BuildCache, BuildTarget, CopySlots, Forward, SetLinearForwards, Shutdown, sequence_on
from .sharding import shard_model

log = logging.getLogger(__name__)


def serve(group: TensorParallelGroup, model: torch.nn.Module, name: str) -> None:
    """Run rank 0's operations on this rank's shard ``model`` until :class:`Shutdown`."""
    device = group.device
    target: TargetModel | None = None
    cache: PagedKVCache | None = None
    block_size = 0
    nothing = torch.empty(0, dtype=torch.long, device=device)
    while True:
        message = group.receive()
        if isinstance(message, Forward):
            layout = AttentionLayout([sequence_on(s, device) for s in message.sequences], block_size, device)
            target.forward(message.input_ids.to(device), message.positions.to(device),
                           ForwardMetadata(cache=cache, layout=layout, batch_invariant=message.batch_invariant),
                           nothing)
        elif isinstance(message, CopySlots):
            cache.copy_slots(message.src.to(device), message.dst.to(device))
        elif isinstance(message, BuildTarget):
            target = TargetModel(model, None, name)
        elif isinstance(message, SetLinearForwards):
            target.set_linear_forwards(message.batch_invariant, message.prepack)
        elif isinstance(message, BuildCache):
            cache = PagedKVCache(target.layer_shapes, message.num_blocks, message.block_size, target.dtype, device)
            block_size = message.block_size
        elif isinstance(message, Shutdown):
            return
        else:
            raise TypeError(f"a tensor-parallel worker got an unknown operation {message!r}")


def run(config, group: TensorParallelGroup, dtype: torch.dtype) -> None:
    """Load this rank's shard of ``config``'s target and serve rank 0 until it stops."""
    model, path = load_weights(config.model, None, dtype, group.device)
    shard_model(model, group.rank, group.size, group)
    group.loaded()
    serve(group, model, model_display_name(config.model, path))


def main() -> int:
    """A worker started by rank 0 on this machine."""
    from ..config_loading import config_from_dict

    logging.basicConfig(level=logging.WARNING, format=f"specdec worker {os.environ.get('RANK')}: %(message)s")
    with open(os.environ[CONFIG_ENV]) as f:
        config = config_from_dict(json.load(f))
    torch.set_num_threads(threads_per_rank(config))
    device = resolve_device(config.device)
    group = None
    try:
        group = TensorParallelGroup.start(config, device)
        run(config, group, resolve_dtype(config.dtype))
    except Exception as exc:  # noqa: BLE001 - rank 0 reports the rank gone; the reason is here
        log.error("rank %s stops: %s: %s", os.environ.get("RANK"), type(exc).__name__, exc)
        return 1
    finally:
        if group is not None:
            group.close()
    return 0

