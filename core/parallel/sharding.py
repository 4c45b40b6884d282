"""Sharding a transformers model by its own tensor-parallel plan.

The plan is transformers' (``config.base_model_tp_plan``: which linear layers split by output
columns, ``colwise``, and which by input rows, ``rowwise``); the shards are plain
``nn.Linear`` modules holding this rank's slice. A rowwise layer's partial products are summed
over the group by a forward hook (one all-reduce, then the bias, added once). Plain local
modules rather than transformers' DTensor styles: those replace each module's ``forward``,
which specdec's own linear kernels (batch-invariant, prepacked) replace too; a hook composes
with any forward. The attention code is unmodified: it reshapes its projections with ``-1``
heads, so each rank runs its own query and KV heads, and specdec's paged cache on each rank
holds that rank's KV heads. Embeddings and the LM head stay whole on every rank, so that
drafters on rank 0 use them alone.
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable

import torch

from ..errors import ConfigError
from ..model.hf_config import text_config

#: the plan styles taken, and replicated ones that need nothing at inference
SPLIT_STYLES = ("colwise", "rowwise")
REPLICATED_STYLES = ("replicated_with_grad_allreduce", "replicate")


def tp_plan(model) -> dict[str, str]:
    """The model's tensor-parallel plan, keyed by module name (``model.layers.*.mlp.up_proj``)."""
    config = text_config(model.config)
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise ConfigError(f"engine.tensor_parallel_size: {type(model).__name__} comes with no tensor-parallel "
                          "plan in transformers (config.base_model_tp_plan); run it with tensor_parallel_size: 1")
    prefix = getattr(model, "base_model_prefix", "model")
    return {f"{prefix}.{pattern}": style for pattern, style in plan.items()}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_divides(config, size: int) -> None:
    """A ConfigError naming the sizes and the degrees that work when ``size`` does not divide
    the model's attention heads, KV heads and MLP width."""
    config = text_config(config)
    sizes = {"attention heads": config.num_attention_heads,
             "KV heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
             "MLP width (intermediate_size)": getattr(config, "intermediate_size", None)}
    sizes = {name: n for name, n in sizes.items() if isinstance(n, int)}
    bad = {name: n for name, n in sizes.items() if n % size}
    if bad:
        working = sorted(set.intersection(*(set(_divisors(n)) for n in sizes.values())))
        raise ConfigError(f"engine.tensor_parallel_size: {size} does not divide the model's "
                          + ", ".join(f"{name} ({n})" for name, n in bad.items())
                          + f"; degrees that divide all of {', '.join(f'{k} {v}' for k, v in sizes.items())}: "
                          + ", ".join(map(str, working)))


def shard_model(model: torch.nn.Module, rank: int, size: int, group) -> int:
    """Replace every linear layer the plan splits with this rank's slice; returns how many.
    ``group``: the :class:`~.group.TensorParallelGroup` whose forward group a rowwise layer's
    partial sums are reduced over (and which counts the seconds they take)."""
    check_divides(model.config, size)
    plan = tp_plan(model)
    count = 0
    for name, module in list(model.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or style in REPLICATED_STYLES:
            continue
        if style not in SPLIT_STYLES or type(module) is not torch.nn.Linear:
            raise ConfigError(f"engine.tensor_parallel_size: {type(model).__name__}'s plan shards {name} "
                              f"({type(module).__name__}) as {style!r}; specdec splits plain linear layers "
                              f"{' and '.join(SPLIT_STYLES)} only: run this model with tensor_parallel_size: 1")
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _slice(module, style, rank, size, group))
        count += 1
    return count


def _slice(layer: torch.nn.Linear, style: str, rank: int, size: int, group) -> torch.nn.Linear:
    dim = 0 if style == "colwise" else 1
    weight = layer.weight.detach().chunk(size, dim=dim)[rank].contiguous()
    shard = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None and dim == 0,
                            device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(weight)
        if shard.bias is not None:
            shard.bias.copy_(layer.bias.detach().chunk(size)[rank])
    if style == "rowwise":
        bias = None if layer.bias is None else layer.bias.detach().clone()
        shard.register_forward_hook(_reduce_partial_sums(group, bias))
    return shard


def _reduce_partial_sums(group, bias: torch.Tensor | None) -> Callable:
    def hook(_module, _inputs, output):
        started = time.perf_counter()
        with group.guard("summing a layer's partial products"):
            group.forward_group.allreduce([output]).wait()
        group.collective_seconds += time.perf_counter() - started
        return output if bias is None else output + bias

    return hook
