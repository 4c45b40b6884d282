"""Compute kernels behind stable interfaces: Triton on CUDA, torch references elsewhere.

``SPECDEC_KERNELS=torch`` forces the torch references (for comparison on a GPU).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING

import torch

from .argmax import argmax_rows
from .attention import gather_context, grouped_attention, paged_attention_torch
from .cpu import invariant_attention_cpu
from .cpu import inverse_cdf as inverse_cdf_cpu
from .cpu import kernel_available as cpu_kernel_available
from .cpu import kernel_fits as cpu_kernel_fits
from .cpu import sampling_probs as sampling_probs_cpu
from .invariant_attention import invariant_attention_torch
from .kv_copy import copy_kv_slots_torch
from .prepacked import prepack_linear, prepack_linears
from .verify import chain_rejection_torch, greedy_tree_verify_torch

if TYPE_CHECKING:
    from ..kvcache.layout import AttentionLayout

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
    return _triton_serves(tensor.device, kernel)


def _triton_serves(device: torch.device, kernel: str) -> bool:
    return (device.type == "cuda" and os.environ.get("SPECDEC_KERNELS", "auto") != "torch" and kernel not in _failed
            and _triton() is not None)


class KernelError(RuntimeError):
    """A kernel failed after it had already written part of its output: the reference
    cannot be run on top of that, so the step fails loudly."""


def _give_up(name: str, exc: Exception) -> None:
    _failed.add(name)
    log.warning("Triton kernel %s failed (%s: %s); using the torch reference from now on",
                name, type(exc).__name__, exc)


def _dispatch(name: str, tensor: torch.Tensor, reference, *args):
    """Run the Triton kernel ``name`` on CUDA, else ``reference``. A kernel that fails (say,
    to compile on an untested GPU) is reported once and replaced by its reference; only
    kernels that write nothing but their result go through here (a failed launch leaves
    no partial effect for the reference to run on top of)."""
    if use_triton(tensor, name):
        try:
            return getattr(_triton(), name)(*args)
        except Exception as exc:  # noqa: BLE001 - any kernel failure falls back to the reference
            _give_up(name, exc)
    return reference(*args)


def paged_attention_is_triton(device: torch.device | str) -> bool:
    """Whether :func:`paged_attention` runs the Triton kernel on ``device`` (else the torch
    reference, which pads sequences of similar width into groups)."""
    return _triton_serves(torch.device(device), "paged_attention_triton")


def paged_attention(query, key_pool, value_pool, layout: AttentionLayout, scale, sliding_window=None, softcap=None):
    if layout.has_pending and sliding_window:  # pending draft nodes' key positions: only the reference reads them
        return paged_attention_torch(query, key_pool, value_pool, layout, scale, sliding_window, softcap)
    return _dispatch("paged_attention_triton", query, paged_attention_torch,
                     query, key_pool, value_pool, layout, scale, sliding_window, softcap)


def invariant_attention_is_kernel(device: torch.device | str) -> bool:
    """Whether :func:`invariant_attention` runs a kernel on ``device`` (Triton on CUDA, the C++
    one on the CPU: every token over its own key row, draft tree nodes as cheap as chain
    tokens), else the torch version (padded groups of rows, draft trees as a batch of
    their own)."""
    device = torch.device(device)
    if device.type == "cpu":
        return cpu_kernel_available()
    return _triton_serves(device, "invariant_attention_triton")


def invariant_attention(query, key_pool, value_pool, layout: AttentionLayout, scale, sliding_window=None,
                        softcap=None):
    """Attention whose result for a token does not depend on the rest of the step
    (:mod:`.invariant_attention`): the Triton kernel on CUDA, the C++ kernel on the CPU (one
    reduction order per query by construction), the torch version where neither runs."""
    if query.device.type == "cpu" and cpu_kernel_fits(query, key_pool, value_pool):
        return invariant_attention_cpu(query, key_pool, value_pool, layout, scale, sliding_window, softcap)
    return _dispatch("invariant_attention_triton", query, invariant_attention_torch,
                     query, key_pool, value_pool, layout, scale, sliding_window, softcap)


def copy_kv_slots(keys, values, src, dst) -> None:
    """Copy K/V rows in place: two launches (keys, then values). If the first fails nothing
    was written and the reference does the copy; if the second fails the keys are already
    moved, and rerunning the reference on them would read overwritten rows, so it raises."""
    name = "copy_kv_slots_triton"
    if not use_triton(keys, name):
        return copy_kv_slots_torch(keys, values, src, dst)
    try:
        _triton().copy_rows_triton(keys, src, dst)
    except Exception as exc:  # noqa: BLE001 - nothing written yet: the reference is safe
        _give_up(name, exc)
        return copy_kv_slots_torch(keys, values, src, dst)
    try:
        _triton().copy_rows_triton(values, src, dst)
    except Exception as exc:
        _failed.add(name)
        raise KernelError(f"Triton kernel {name} failed after moving the keys, before the values "
                          f"({type(exc).__name__}: {exc}); this step's KV cache is inconsistent. Later steps use "
                          "the torch reference; set SPECDEC_KERNELS=torch to avoid the kernel from the start") from exc


def greedy_tree_verify(target_tokens, *args):
    return _dispatch("greedy_tree_verify_triton", target_tokens, greedy_tree_verify_torch, target_tokens, *args)


def chain_rejection(p, *args):
    return _dispatch("chain_rejection_triton", p, chain_rejection_torch, p, *args)


def __getattr__(name: str):  # names that moved out, for one release
    from .._moved import moved_attribute

    return moved_attribute(__name__, name)


__all__ = ["KernelError", "argmax_rows", "chain_rejection", "copy_kv_slots", "cpu_kernel_available", "gather_context",
           "greedy_tree_verify", "grouped_attention", "invariant_attention", "invariant_attention_is_kernel",
           "inverse_cdf_cpu", "paged_attention", "paged_attention_is_triton", "prepack_linear", "prepack_linears",
           "sampling_probs_cpu", "use_triton"]
