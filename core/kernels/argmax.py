"""The index of the largest value of each row, as ``torch.argmax(x, -1)``.

torch's CPU argmax does not vectorise a reduction over a row of the vocabulary; numpy's
does (about ten times faster on a 49,152-logit row: BENCHMARKS.md, "Verifying a step").
Both give the first index of the maximum, and of a NaN where a row holds one, so
the answer is the same; other devices and dtypes, and tensors that need their graph,
keep torch's.
"""

from __future__ import annotations

import torch

_NUMPY_DTYPES = (torch.float32, torch.float64)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (int64), through numpy for CPU float tensors."""
    if x.device.type != "cpu" or x.dtype not in _NUMPY_DTYPES or x.requires_grad or x.dim() == 0:
        return x.argmax(-1)
    return torch.as_tensor(x.numpy().argmax(-1), dtype=torch.int64)
