"""Batch-invariant numerics: a token's result depends on nothing but its own sequence.

Why this is needed: matrix-multiply libraries pick their kernel by shape, and different
kernels add the same products in different orders: a row's result changes with the number
of rows sharing the call (oneDNN's bfloat16 ``linear`` over long reductions, float32
``matmul`` at small row counts), and the attention's with the key count. So in bfloat16 a
greedy answer could change with the drafts verified beside it and the requests batched
with it.

The mode fixes the shape of every reduction a token goes through, so that only the
batch dimension varies (which no kernel reorders):

- linear layers pad their rows, split their input dimension and cap the rows of a call as
  a :class:`LinearPlan` found by trying on this machine at first use (:func:`linear_plan`:
  the thresholds are the kernel library's, and a CPU with AMX switches kernels at a row
  count where one without does not), the slices' products added in float32 in a fixed
  order; on CUDA they multiply a fixed number of rows per call
  (:data:`CUDA_CHUNK_ROWS`); on a CPU without
  bfloat16 instructions, bfloat16 layers run specdec's linear kernel (:mod:`specdec.kernels.cpu`), which
  sums every output in one order whatever the row count;
- attention runs in float32 over *key rows*, a fixed-length reduction over each query's
  own keys (:mod:`specdec.kernels.invariant_attention`, and the CPU and Triton kernels
  that equal it).

CUDA has its own paths: cuBLAS chooses kernels by shape in ways the CPU's plans do not
cover.
"""

from __future__ import annotations

import functools
import logging

import attrs
import torch
import torch.nn.functional as F

from ..kernels import cpu
from ..kernels.cpu import kernel_linear_forward, linear_kernel_fits
from ..kernels.invariant_attention import ROW_MULTIPLE
from ..kernels.prepacked import can_prepack, pack_weight, packed_linear

log = logging.getLogger(__name__)

#: row counts checked when a linear shape is calibrated, up to a prefill chunk's: a kernel
#: switch can change as little as one output in 20,000, so the checks span many rows.
_CHECK_ROWS = (2, 3, 4, 5, 7, 8, 11, 16, 17, 31, 32, 33, 40, 64, 65, 100, 128, 129, 257, 512)
#: on the CPU, the row caps tried per call where one call for all rows is not invariant.
_CPU_CHUNKS = (32, 16)
#: on CUDA, linear layers run in calls of exactly this many rows: cuBLAS picks its kernel
#: (and split of the reduction) by the row count, so only a fixed count is safe for any batch.
CUDA_CHUNK_ROWS = 64


# -- linear -----------------------------------------------------------------------------

@attrs.frozen
class LinearPlan:
    """How to run one linear shape batch-invariantly: rows padded to a multiple of
    ``row_multiple``; the input dimension cut in ``parts`` equal slices whose products
    (:func:`plan_weight`) are added in float32 in a fixed order; with ``chunk`` (a multiple
    of ``row_multiple``), at most ``chunk`` rows a call."""

    row_multiple: int
    parts: int
    chunk: int = 0

    @property
    def is_stock(self) -> bool:
        return self.row_multiple == 1 and self.parts == 1 and not self.chunk


def plan_weight(weight: torch.Tensor, plan: LinearPlan) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``weight`` (``[out, in]``) as :func:`planned_linear` multiplies by it under ``plan``.

    One part: the weight itself, or prepacked for oneDNN where that is exact
    (:mod:`specdec.kernels.prepacked`). Several parts: each slice ``[out, in / parts]`` prepacked where that
    is exact (bfloat16 on the CPU), one product per slice; else ``[parts, in / parts, out]``
    for one batched ``bmm``, which reorders the weight at every call."""
    if plan.parts == 1:
        return pack_weight(weight) if can_prepack(weight) else weight
    slices = weight.detach().view(weight.shape[0], plan.parts, -1)
    if can_prepack(slices[:, 0]):
        return tuple(pack_weight(slices[:, i].contiguous()) for i in range(plan.parts))
    return slices.permute(1, 2, 0).contiguous()


def planned_linear(x: torch.Tensor, weight: torch.Tensor | tuple, bias: torch.Tensor | None,
                   plan: LinearPlan) -> torch.Tensor:
    """``F.linear`` under ``plan``; ``weight`` as :func:`plan_weight` made it."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    rows = x.shape[0]
    padding = -rows % plan.row_multiple
    if padding:
        x = torch.cat([x, x.new_zeros(padding, x.shape[1])])
    if plan.chunk and len(x) > plan.chunk:
        out = torch.cat([_product(part, weight, bias, plan.parts) for part in x.split(plan.chunk)])
    else:
        out = _product(x, weight, bias, plan.parts)
    if padding:
        out = out[:rows]
    return out.view(*shape[:-1], out.shape[-1])


def _product(x: torch.Tensor, weight, bias: torch.Tensor | None, parts: int) -> torch.Tensor:
    if parts == 1:
        return packed_linear(x, weight, bias) if weight.is_mkldnn else F.linear(x, weight, bias)
    if isinstance(weight, tuple):  # prepacked slices
        width = x.shape[1] // parts
        acc = packed_linear(x[:, :width], weight[0]).float()
        for i in range(1, parts):
            acc.add_(packed_linear(x[:, i * width:(i + 1) * width], weight[i]))
    else:
        products = torch.bmm(x.view(len(x), parts, -1).transpose(0, 1), weight)
        acc = products[0].float()
        for part in products[1:]:
            acc.add_(part)
    if bias is not None:
        acc.add_(bias)
    return acc.to(x.dtype)


def _calibration_inputs(out_features: int, in_features: int, rows: int, has_bias: bool, device: str,
                        dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]]:
    """(weight, bias, rows of input) a plan is checked on: Gaussian numbers, and numbers
    whose sums cancel (pairs of equal weight columns met by ``+-2**16``), where a change in
    the order of additions shows in a far larger share of the outputs. A kernel switch can
    change as little as one output in 20,000 on Gaussian numbers alone."""
    g = torch.Generator().manual_seed(1)
    inputs = []
    for cancelling in (False, True):
        weight = torch.randn(out_features, in_features, generator=g) * in_features ** -0.5
        x = torch.randn(rows, in_features, generator=g)
        if cancelling and in_features >= 2:
            weight[:, 1::2] = weight[:, 0:in_features - in_features % 2:2]
            cols = torch.randint(0, in_features // 2, (rows, 4), generator=g) * 2
            big = (torch.randint(0, 2, (rows, 4), generator=g) * 2 - 1.0) * 2.0 ** 16
            row = torch.arange(rows)[:, None].expand(rows, 4)
            x[row, cols], x[row, cols + 1] = big, -big
        bias = torch.randn(out_features, generator=g).to(device, dtype) if has_bias else None
        inputs.append((weight.to(device, dtype), bias, x.to(device, dtype)))
    return inputs


def _rows_invariant(weight: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor, plan: LinearPlan) -> bool:
    # a capped plan's calls never exceed its cap: row counts up to it and two past it say all
    checks = sorted({m for m in _CHECK_ROWS if m <= len(x) and (not plan.chunk or m <= plan.chunk)}
                    | ({plan.chunk + 1, 2 * plan.chunk + 3} if plan.chunk else set()))
    w = plan_weight(weight, plan)
    alone: list[torch.Tensor] = []  # each row on its own, computed as far as a check needs (most plans fail early)
    for m in checks:
        alone += [planned_linear(x[i:i + 1], w, bias, plan) for i in range(len(alone), m)]
        if not torch.equal(planned_linear(x[:m], w, bias, plan), torch.cat(alone)):
            return False
    return True


@functools.cache
def _linear_plan(out_features: int, in_features: int, dtype: torch.dtype, device: str, threads: int,
                 has_bias: bool) -> LinearPlan:
    divisors = [p for p in range(1, in_features // 64 + 1) if in_features % p == 0] or [1]
    if device == "cuda":
        plans = [LinearPlan(CUDA_CHUNK_ROWS, parts, CUDA_CHUNK_ROWS) for parts in divisors]
    else:
        # cheapest first: padding a decode step's row to a few rows costs next to nothing
        # where the product streams its weight; capping a call's rows costs calls on a long
        # prefill only; cutting the input into parts costs a product per part on every call
        plans = [LinearPlan(row_multiple, parts, chunk) for parts in divisors for chunk in (0,) + _CPU_CHUNKS
                 for row_multiple in (1, ROW_MULTIPLE, 2 * ROW_MULTIPLE)]
    inputs = _calibration_inputs(out_features, in_features, max(_CHECK_ROWS), has_bias, device, dtype)
    with torch.inference_mode():
        found = next((plan for plan in plans if all(_rows_invariant(*data, plan) for data in inputs)), None)
    if found is None:
        raise RuntimeError(f"no batch-invariant way to compute a {in_features}x{out_features} {dtype} linear on "
                           f"{device} was found; turn engine.batch_invariant off for this model")
    if not found.is_stock:
        log.info("batch-invariant %s linear %dx%d on %s: %s", dtype, in_features, out_features, device, found)
    return found


def linear_plan(weight: torch.Tensor, bias: torch.Tensor | None = None) -> LinearPlan:
    """The :class:`LinearPlan` under which ``weight`` (``[out, in]``) and ``bias`` give each
    row the same result however many rows share the call: found by trying, once per shape,
    dtype, device, thread count and whether a bias is added (the thresholds are the kernel
    library's)."""
    return _linear_plan(weight.shape[0], weight.shape[1], weight.dtype, weight.device.type, torch.get_num_threads(),
                        bias is not None)


def linear_costs_nothing(weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether the mode's product with ``weight`` costs what the stock one costs: the CPU
    linear kernel's (no bfloat16 instructions), or, on a CPU with them, a plan that at most
    pads rows (a decode row padded to four costs next to nothing where the product streams
    its weight; cutting the input dimension costs a product per part)."""
    if linear_kernel_fits(weight):
        return True
    if not (cpu.native_bfloat16() and weight.device.type == "cpu" and weight.dtype == torch.bfloat16
            and weight.dim() == 2):
        return False
    try:
        plan = linear_plan(weight, bias)
    except RuntimeError:
        return False
    return plan.parts == 1 and not plan.chunk


def mode_costs_nothing(model: torch.nn.Module, layer_shapes: list[tuple[int, int, int]]) -> bool:
    """Whether the mode would run all of ``model``'s work as cheaply as stock numerics, which
    is what ``engine.batch_invariant: auto`` asks: every weight matrix an ``nn.Linear`` whose
    product :func:`linear_costs_nothing` (or an embedding, which only gathers; an MoE's fused
    expert tensors are neither), every layer's key and value dimensions in whole vectors of
    the C++ attention kernel (``layer_shapes`` as the KV cache's), and that kernel built."""
    if not cpu.kernel_available():
        return False
    if not all(key_dim % cpu.LANES == 0 and value_dim % cpu.LANES == 0 for _, key_dim, value_dim in layer_shapes):
        return False
    covered = set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            if not linear_costs_nothing(module.weight, module.bias):  # a tied LM head too: its product is checked
                return False
            covered.add(id(module.weight))
        elif isinstance(module, torch.nn.Embedding):
            covered.add(id(module.weight))
    return all(id(p) in covered for p in model.parameters() if p.dim() >= 2)


def make_linear_invariant(module: torch.nn.Linear) -> bool:
    """Give ``module`` a batch-invariant forward (undo with :func:`restore_linear`); False
    where its stock forward is invariant already (and is left in place). The CPU linear
    kernel, invariant by construction, where it fits (:func:`specdec.kernels.cpu.linear_kernel_fits`);
    else a plan, whose one-part products multiply by the weight prepacked for oneDNN where
    that is exact (:mod:`specdec.kernels.prepacked`)."""
    if linear_kernel_fits(module.weight):
        module.forward = kernel_linear_forward(module)
        return True
    plan = linear_plan(module.weight, module.bias)
    if plan.is_stock:
        return False
    module.forward = functools.partial(planned_linear, weight=plan_weight(module.weight, plan), bias=module.bias,
                                       plan=plan)
    return True


def restore_linear(module: torch.nn.Linear) -> None:
    module.__dict__.pop("forward", None)
