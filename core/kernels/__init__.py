"""Compute kernels behind stable interfaces: Triton on CUDA, torch references elsewhere.

``SPECDEC_KERNELS=torch`` forces the torch references (for comparison on a GPU).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from .attention import paged_attention_torch
from .kv_copy import copy_kv_slots_torch
from .layout import AttentionLayout, SequenceSlice
from .verify import chain_rejection_torch, greedy_tree_verify_torch

log = logging.getLogger(__name__)


@functools.cache
def _triton():
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


_failed: set[str] = set()


def use_triton(tensor: torch.Tensor, kernel: str = "") -> bool:
    return (tensor.is_cuda and os.environ.get("SPECDEC_KERNELS", "auto") != "torch" and kernel not in _failed
            and _triton() is not None)


def _dispatch(name: str, tensor: torch.Tensor, reference, *args):
    """Run the Triton kernel ``name`` on CUDA, else ``reference``. A kernel that fails (say,
    to compile on an untested GPU) is reported once and replaced by its reference."""
    if use_triton(tensor, name):
        try:
            return getattr(_triton(), name)(*args)
        except Exception as exc:  # noqa: BLE001 - any kernel failure falls back to the reference
            _failed.add(name)
            log.warning("Triton kernel %s failed (%s: %s); using the torch reference from now on",
                        name, type(exc).__name__, exc)
    return reference(*args)


def paged_attention(query, key_pool, value_pool, layout: AttentionLayout, scale, sliding_window=None, softcap=None):
    if layout.has_pending:  # draft-tree levels: only the reference reads pending masks
        return paged_attention_torch(query, key_pool, value_pool, layout, scale, sliding_window, softcap)
    return _dispatch("paged_attention_triton", query, paged_attention_torch,
                     query, key_pool, value_pool, layout, scale, sliding_window, softcap)


def copy_kv_slots(keys, values, src, dst) -> None:
    return _dispatch("copy_kv_slots_triton", keys, copy_kv_slots_torch, keys, values, src, dst)


def greedy_tree_verify(target_tokens, *args):
    return _dispatch("greedy_tree_verify_triton", target_tokens, greedy_tree_verify_torch, target_tokens, *args)


def chain_rejection(p, *args):
    return _dispatch("chain_rejection_triton", p, chain_rejection_torch, p, *args)


__all__ = ["AttentionLayout", "SequenceSlice", "chain_rejection", "copy_kv_slots", "greedy_tree_verify",
           "paged_attention", "use_triton"]
