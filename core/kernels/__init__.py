"""Compute kernels behind stable interfaces: Triton on CUDA, torch references elsewhere.

``SPECDEC_KERNELS=torch`` forces the torch references (for comparison on a GPU).
"""

from __future__ import annotations

import functools
import os

import torch

from .attention import paged_attention_torch
from .kv_copy import copy_kv_slots_torch
from .layout import AttentionLayout, SequenceSlice
from .verify import chain_rejection_torch, greedy_tree_verify_torch


@functools.cache
def _triton():
    try:
        from . import triton_kernels
    except ImportError:
        return None
    return triton_kernels


def use_triton(tensor: torch.Tensor) -> bool:
    return tensor.is_cuda and os.environ.get("SPECDEC_KERNELS", "auto") != "torch" and _triton() is not None


def paged_attention(query, key_pool, value_pool, layout: AttentionLayout, scale, sliding_window=None, softcap=None,
                    mask_cache=None):
    if use_triton(query):
        return _triton().paged_attention_triton(query, key_pool, value_pool, layout, scale, sliding_window, softcap)
    return paged_attention_torch(query, key_pool, value_pool, layout, scale, sliding_window, softcap, mask_cache)


def copy_kv_slots(keys, values, src, dst) -> None:
    if use_triton(keys):
        return _triton().copy_kv_slots_triton(keys, values, src, dst)
    return copy_kv_slots_torch(keys, values, src, dst)


def greedy_tree_verify(target_tokens, *args):
    impl = _triton().greedy_tree_verify_triton if use_triton(target_tokens) else greedy_tree_verify_torch
    return impl(target_tokens, *args)


def chain_rejection(p, *args):
    impl = _triton().chain_rejection_triton if use_triton(p) else chain_rejection_torch
    return impl(p, *args)


__all__ = ["AttentionLayout", "SequenceSlice", "chain_rejection", "copy_kv_slots", "greedy_tree_verify",
           "paged_attention", "use_triton"]
