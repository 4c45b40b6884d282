"""bfloat16 linear layers on the CPU with their weights reordered for oneDNN once.

Why: a CPU bfloat16 ``F.linear`` hands oneDNN a plain ``[out, in]`` matrix, which it
reorders into its blocked layout on every call. For a decode step's few rows that reorder
costs as much as the product for one row, so the weight is reordered once
(``mkldnn._reorder_linear_weight``, ``mkldnn._linear_pointwise``, what inductor's weight
prepacking uses).

The reordered product runs the same kernel on the same numbers, so its result is
bit-identical to ``F.linear``'s: each weight shape is checked once on this machine
(:func:`packing_is_exact`, for several row counts) and left stock where it is not, so
outputs, losslessness and the batch-invariant mode's plans are unchanged. The packed
weight is a second copy: the module keeps its ``weight`` for drafters and training.

On a CPU without bfloat16 instructions oneDNN refuses the reorder and torch multiplies a
bfloat16 ``F.linear`` one row at a time; there :func:`prepack_linear` gives the layer
specdec's linear kernel instead (:func:`specdec.kernels.cpu.kernel_linear`: no copy, not
bit-identical to ``F.linear``, many times faster on steps of several tokens).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .cpu import kernel_linear_forward, linear_kernel_fits

#: row counts compared with ``F.linear`` when a weight shape is checked.
_CHECK_ROWS = (1, 2, 5, 8, 16, 33, 64)


def can_prepack(weight: torch.Tensor) -> bool:
    """A bfloat16 CPU weight on a torch with oneDNN, whose reordered product is exact here."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and packing_is_exact(weight.shape[0], weight.shape[1], torch.get_num_threads()))


@functools.cache
def packing_is_exact(out_features: int, in_features: int, threads: int) -> bool:
    """Whether a reordered ``[out, in]`` bfloat16 weight multiplies bit-identically to
    ``F.linear`` (with a bias too) for every row count of :data:`_CHECK_ROWS`."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    x = torch.randn(max(_CHECK_ROWS), in_features, generator=g).to(torch.bfloat16)
    try:
        packed = pack_weight(weight)
        return all(torch.equal(packed_linear(x[:m], packed, b), F.linear(x[:m], weight, b))
                   for m in _CHECK_ROWS for b in (None, bias))
    except RuntimeError:  # an oneDNN build without this product
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in oneDNN's blocked layout (an opaque ``mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight packed by :func:`pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def prepack_linear(module: torch.nn.Linear) -> bool:
    """Give ``module`` a forward on its packed weight where :func:`can_prepack` says yes, else
    on the linear kernel where it fits (undo either with :func:`specdec.numerics.invariant.restore_linear`);
    False where neither applies."""
    if module.bias is not None and module.bias.dtype != torch.bfloat16:
        return False
    if can_prepack(module.weight):
        module.forward = functools.partial(packed_linear, packed=pack_weight(module.weight),
                                           bias=None if module.bias is None else module.bias.detach())
    elif linear_kernel_fits(module.weight):
        module.forward = kernel_linear_forward(module)
    else:
        return False
    return True


def prepack_linears(module: torch.nn.Module) -> int:
    """:func:`prepack_linear` every linear layer of ``module`` still on its stock forward;
    returns how many were packed."""
    return sum(prepack_linear(m) for m in module.modules()
               if isinstance(m, torch.nn.Linear) and "forward" not in m.__dict__)
