"""Targets kept for reuse within a process.

Loading a target and compiling its graphs costs seconds (minutes with torch's caches
empty). An ``LLM`` that asks for a target this process already holds, with the same
weights, tokenizer, numerics and compilation (:func:`reuse_key`; a setting asked for by
value matches an ``auto`` that resolved to it), gets that target and its compiled graphs
instead of a copy: a script, a benchmark or a test suite building one
``LLM`` after another pays once. Sharing is safe because engines only read a target: each
has its own KV cache and names the hidden states it wants in every forward.

A target stays while an ``LLM`` uses it; the most recent one also stays after, until
another is loaded or :func:`release_kept_targets` is called.
"""

from __future__ import annotations

import threading
import weakref

from ..config import SpecdecConfig
from .target import TargetModel

_targets: weakref.WeakValueDictionary[tuple, TargetModel] = weakref.WeakValueDictionary()
_last: list[TargetModel] = []  # the most recent target, kept alive
_lock = threading.Lock()


def reuse_key(config: SpecdecConfig, dtype, device) -> tuple | None:
    """What makes two targets interchangeable: ``config`` with its quantization resolved,
    and the resolved dtype and device. None where a target is never shared (tensor
    parallelism: its workers hold the other shards)."""
    engine = config.engine
    if engine.tensor_parallel_size > 1:
        return None
    return (config.model, config.tokenizer, str(dtype), str(device), engine.quantization, engine.max_model_len,
            engine.compile, engine.batch_invariant, engine.prepack_weights, engine.cuda_graphs)


def kept_target(key: tuple | None) -> TargetModel | None:
    """The target held for ``key``, or None."""
    if key is None:
        return None
    with _lock:
        target = _targets.get(key)
        if target is not None:
            _last[:] = [target]
        return target


def keep_target(key: tuple | None, target: TargetModel) -> None:
    """Hold ``target`` for ``key`` (nothing for a key of None)."""
    if key is None:
        return
    with _lock:
        _targets[key] = target
        _last[:] = [target]


def release_kept_targets() -> None:
    """Let the target kept after its last ``LLM`` go (targets in use stay, unshared from now on)."""
    with _lock:
        _targets.clear()
        _last.clear()
