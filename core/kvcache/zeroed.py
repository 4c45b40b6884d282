"""Cache pools whose memory the OS zeroes and commits page by page, as they are written.

A pool is sized for the longest and widest batches an engine may ever serve (a GiB by
default), and most of it is never written by most processes. ``torch.zeros`` writes every
byte at once: each engine's start paid for the whole pool and kept it resident from the
first step. An anonymous memory map is zero by definition and takes memory only where
written, so the pool costs what its requests use. Devices other than the CPU allocate with
``torch.zeros``: their memset is fast and their memory is reserved anyway.
"""

from __future__ import annotations

import mmap

import torch


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of zeros of ``shape``; on the CPU, its memory committed where first written."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = torch.Size(shape).numel()
    nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()  # a map of 0 bytes is refused
    # the tensor holds the map (a buffer export): it is unmapped when the tensor is freed
    flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)
    return flat.view(dtype)[:numel].view(shape)
