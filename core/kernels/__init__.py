"""Compute kernels behind stable interfaces, each with a torch reference implementation."""

from .attention import paged_attention
from .kv_copy import copy_kv_slots

__all__ = ["copy_kv_slots", "paged_attention"]
