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
  bfloat16 instructions, bfloat16 layers run specdec's linear kernel (:mod:`.cpu`), which
  sums every output in one order whatever the row count;
- attention runs in float32 over *key rows*: a query at position ``p`` sees the keys of
  positions ``0..p`` at columns ``0..p``, as plain decoding lays them out (a draft tree's
  ancestors compacted); rows are padded to a multiple of :data:`KEY_BLOCK` keys (scores
  and softmax do not change with that padding), products have a multiple of
  :data:`ROW_MULTIPLE` query rows (which the library treats alike), and the values are
  summed :data:`KEY_BLOCK` keys at a time, the block sums added in order, so the
  reduction over keys has a fixed length whatever the row's width. A draft tree's nodes
  are computed together (:func:`_tree_attention`): their rows share the context, so its
  keys and values are gathered once, not once per node, and all the step's trees run as
  one batch. Kernels read the same key
  rows instead where they run: Triton on CUDA (``invariant_attention_triton``), C++ on the
  CPU (:mod:`.cpu`, compiled at first use); each walks one query's row in column order,
  so no library's choice of kernel enters and a tree node costs what a chain token costs.
  The torch version here serves where neither is built.

CUDA has its own paths: cuBLAS chooses kernels by shape in ways the CPU's plans do not
cover.
"""

from __future__ import annotations

import functools
import logging

import attrs
import torch
import torch.nn.functional as F

from . import cpu
from .cpu import kernel_linear_forward, linear_kernel_fits
from .prepacked import can_prepack, pack_weight, packed_linear

log = logging.getLogger(__name__)

#: key rows are padded to a multiple of this, and values are summed a block of this many
#: keys at a time (a fixed-length reduction), the blocks' sums added in order.
KEY_BLOCK = 64
#: rows of an attention product (queries times query heads per KV head) are padded to a
#: multiple of this (1-3 rows round differently from 4, 8 and 12 or more).
ROW_MULTIPLE = 4
#: row counts checked when a linear shape is calibrated, up to a prefill chunk's: a kernel
#: switch can change as little as one output in 20,000, so the checks span many rows.
_CHECK_ROWS = (2, 3, 4, 5, 7, 8, 11, 16, 17, 31, 32, 33, 40, 64, 65, 100, 128, 129, 257, 512)
#: on the CPU, the row caps tried per call where one call for all rows is not invariant.
_CPU_CHUNKS = (32, 16)
#: on CUDA, linear layers run in calls of exactly this many rows: cuBLAS picks its kernel
#: (and split of the reduction) by the row count, so only a fixed count is safe for any batch.
CUDA_CHUNK_ROWS = 64


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (rows and key widths are padded so)."""
    return -(-n // multiple) * multiple


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
    (:mod:`.prepacked`). Several parts: each slice ``[out, in / parts]`` prepacked where that
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
    kernel, invariant by construction, where it fits (:func:`.cpu.linear_kernel_fits`);
    else a plan, whose one-part products multiply by the weight prepacked for oneDNN where
    that is exact (:mod:`.prepacked`)."""
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


# -- attention --------------------------------------------------------------------------

def _group_plan(group: dict, kv_heads: int, rep: int, tokens: int, sliding_window: int | None) -> tuple:
    """Gather indices and the additive mask of one group of key rows, built at a step's first
    layer and cached in the group: ``q_index`` into the ``[heads * T]`` query rows, for every
    KV head and key row its ``rep * M`` query rows (query-head-major) padded to ``height``, a
    multiple of :data:`ROW_MULTIPLE`; ``kv_index`` into the pool's ``[slots * kv_heads]``
    rows, KV-head-major; ``bias`` ``[kv_heads * R, height, W]``; ``o_index``: per real
    query (the group's token order) and query head, its row among the outputs."""
    key = ("plan", kv_heads, rep, tokens, sliding_window)
    if key not in group:
        slots, queries, real = group["slots"], group["queries"], group["rows"]
        rows, width = slots.shape
        m = queries.shape[1]
        height = round_up(rep * m, ROW_MULTIPLE)
        per_kv = torch.arange(kv_heads, device=slots.device)
        q_index = torch.zeros(kv_heads, rows, height, dtype=torch.long, device=slots.device)
        q_index[:, :, :rep * m] = (per_kv[:, None, None, None] * rep * tokens
                                   + torch.arange(rep, device=slots.device)[None, None, :, None] * tokens
                                   + queries[None, :, None, :]).reshape(kv_heads, rows, rep * m)
        kv_index = slots[None] * kv_heads + per_kv[:, None, None]
        bias = group["bias"] if sliding_window is None else group["bias"].masked_fill(
            (group["query_pos"][:, :, None] - group["key_pos"][:, None, :]) >= sliding_window, float("-inf"))
        full_bias = torch.zeros(kv_heads, rows, height, width, device=slots.device)
        full_bias[:, :, :rep * m] = bias[None, :, None].expand(kv_heads, rows, rep, m, width).reshape(
            kv_heads, rows, rep * m, width)
        r, j = real // m, real % m
        head = torch.arange(kv_heads * rep, device=slots.device)
        o_index = (head[None, :] // rep * rows * height + r[:, None] * height + head[None, :] % rep * m + j[:, None])
        group[key] = (q_index.flatten(), kv_index.flatten(), full_bias.view(kv_heads * rows, height, width),
                      o_index.flatten(), height)
    return group[key]


def invariant_attention_torch(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor, layout,
                              scale: float, sliding_window: int | None = None,
                              softcap: float | None = None) -> torch.Tensor:
    """Attention of the step's new tokens whose result for a token does not depend on the
    other tokens of the step (see the module docstring); float32 inside.

    ``query`` ``[heads, T, dim]``; the pools ``[slots, kv_heads, dim]`` (new tokens written);
    ``layout.invariant_causal_rows`` and ``layout.invariant_trees`` say which keys each query
    sees. Returns ``[T, heads, value_dim]``.
    Each group of key rows is a dozen operations (the gathers, two products, the softmax, the
    block sums): on this CPU most of a decode step's attention time is their dispatch.
    """
    heads, tokens, dim = query.shape
    kv_heads, dim_v = key_pool.shape[1], value_pool.shape[-1]
    rep = heads // kv_heads
    queries, keys, values = query.reshape(-1, dim), key_pool.view(-1, dim), value_pool.view(-1, dim_v)
    groups, trees = layout.invariant_causal_rows, layout.invariant_trees
    out = None if len(groups) == 1 and trees is None else query.new_empty(tokens, heads, dim_v)
    for g in groups:
        rows, width = g["slots"].shape
        q_index, kv_index, bias, o_index, height = _group_plan(g, kv_heads, rep, tokens, sliding_window)
        n, blocks = kv_heads * rows, width // KEY_BLOCK
        # each KV head's query heads folded into rows: [kv_heads * R, height, dim] against [kv_heads * R, W, dim]
        q = queries.index_select(0, q_index).view(n, height, dim).float()
        # contiguous: for a single row (a decode alone), torch multiplies by a transposed
        # operand with another kernel than for a batch of rows, which rounds differently on
        # some CPUs (an AVX-512 FP16 Xeon, torch 2.13); a batch copied it anyway
        k = keys.index_select(0, kv_index).view(n, width, dim).transpose(1, 2).contiguous().float()
        if softcap is None:
            scores = torch.baddbmm(bias, q, k, alpha=scale)
        else:
            scores = torch.tanh(torch.bmm(q, k) * (scale / softcap)) * softcap + bias
        # values a block of KEY_BLOCK keys at a time: a reduction of fixed length, however wide the row
        probs = torch.softmax(scores, dim=-1).view(n, height, blocks, KEY_BLOCK).transpose(1, 2)
        v = values.index_select(0, kv_index).view(n, blocks, KEY_BLOCK, dim_v).float()
        o = torch.matmul(probs, v).sum(dim=1).view(-1, dim_v)
        o = o.index_select(0, o_index).view(-1, heads, dim_v).to(query.dtype)
        if out is None:
            out = o
        else:
            out.index_copy_(0, g["tokens"], o)
    if trees is not None:
        out.index_copy_(0, trees["node_tokens"], _tree_attention(query, key_pool, value_pool, trees, scale,
                                                                 sliding_window, softcap))
    return out


def _padded_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to a multiple of :data:`ROW_MULTIPLE`."""
    pad = -x.shape[dim] % ROW_MULTIPLE
    if not pad:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim)


def _contiguous_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32 and contiguous, in one copy."""
    return x.to(torch.float32, memory_format=torch.contiguous_format).contiguous()


def _tree_attention(query, key_pool, value_pool, trees: dict, scale: float, sliding_window: int | None,
                    softcap: float | None) -> torch.Tensor:
    """The attention of the draft trees of :attr:`AttentionLayout.invariant_trees`, each
    node getting what its own key row (context, then ancestors) gives it in
    :func:`invariant_attention_torch`, without gathering the context once per node, and
    all trees in one batch: a tree's nodes score against its keys in one product (rows a
    multiple of :data:`ROW_MULTIPLE`, as the per-row products), each node's row gathered
    from them; the value blocks that hold context only, shared by a tree's nodes, in one
    product, the rest per node; each node adds its block results in its row's order. A
    tree of n nodes over a context of c keys gathers ``c + n`` keys and values a layer,
    not ``n * c``. ``[nodes, heads, value_dim]`` in the order of ``trees["node_tokens"]``."""
    heads, _, dim = query.shape
    kv_heads, dim_v = key_pool.shape[1], value_pool.shape[-1]
    rep = heads // kv_heads
    num_trees, n = trees["tokens"].shape
    cols, padded_keys, width = trees["cols"], trees["key_slots"].shape[1], trees["cols"].shape[2]
    shared, own = trees["shared"], trees["own"]
    batch = kv_heads * num_trees

    def gathered(pool: torch.Tensor, slots: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
        """``pool`` rows at ``slots`` (any shape), KV heads moved by ``order``, float32, contiguous."""
        rows = pool.index_select(0, slots.flatten()).view(*slots.shape, kv_heads, pool.shape[-1])
        return _contiguous_float(rows.permute(order))

    # [kv_heads * t, n * rep, dim], node-major: the query heads of a KV head folded into rows
    q = query.index_select(1, trees["tokens"].flatten()).view(kv_heads, rep, num_trees, n, dim)
    q = _contiguous_float(q.permute(0, 2, 3, 1, 4)).view(batch, n * rep, dim)
    k = gathered(key_pool, trees["key_slots"], (2, 0, 3, 1)).view(batch, dim, padded_keys)
    if softcap is None:
        scores = torch.baddbmm(q.new_zeros(batch, n * rep, padded_keys), q, k, alpha=scale)
    else:
        scores = torch.tanh(torch.bmm(q, k) * (scale / softcap)) * softcap
    # a -inf column for the rows' padding, then every node's row: [kv_heads, t, n, rep, W]
    scores = F.pad(scores, (0, 1), value=float("-inf")).view(kv_heads, num_trees, n, rep, -1)
    rows = scores.gather(4, cols[None, :, :, None, :].expand(kv_heads, num_trees, n, rep, width))
    if sliding_window is not None:
        hidden = (trees["query_pos"][:, :, None] - trees["key_pos"]) >= sliding_window
        rows = rows.masked_fill(hidden[None, :, :, None, :], float("-inf"))
    probs = torch.softmax(rows, dim=-1)
    if (shared + own) * KEY_BLOCK > width:  # a tree with fewer context-only blocks reads its own ones further on
        probs = F.pad(probs, (0, (shared + own) * KEY_BLOCK - width))
    parts = []
    if shared:  # context-only blocks: a tree's node rows against the same values
        p_shared = probs[..., :shared * KEY_BLOCK].reshape(kv_heads, num_trees, n * rep, shared, KEY_BLOCK)
        v_shared = gathered(value_pool, trees["shared_slots"].view(num_trees, shared, KEY_BLOCK), (3, 0, 1, 2, 4))
        o_shared = torch.matmul(p_shared.transpose(2, 3), v_shared)  # [kv_heads, t, blocks, n * rep, value_dim]
        parts.append(o_shared.view(kv_heads, num_trees, shared, n, rep, dim_v).transpose(2, 3))
    # the rest per node, on rows padded as the per-row products pad them
    p_own = probs.gather(4, trees["own_pos"][None, :, None, None, :].expand(kv_heads, num_trees, n, rep, -1))
    p_own = _padded_rows(p_own.view(kv_heads, num_trees, n, rep, own, KEY_BLOCK).transpose(3, 4), 4)
    v_own = gathered(value_pool, trees["own_slots"].view(num_trees, n, own, KEY_BLOCK), (4, 0, 1, 2, 3, 5))
    parts.append(torch.matmul(p_own, v_own)[:, :, :, :, :rep])  # [kv_heads, t, n, blocks, rep, value_dim]
    order = trees["block_order"]
    if order is not None:  # trees with fewer context-only blocks take their own blocks sooner
        parts.append(parts[0].new_zeros(kv_heads, num_trees, n, 1, rep, dim_v))
        blocks = torch.cat(parts, 3)
        blocks = blocks.gather(3, order[None, :, None, :, None, None].expand(kv_heads, num_trees, n, -1, rep, dim_v))
    else:
        blocks = torch.cat(parts, 3) if len(parts) > 1 else parts[0]
    o = blocks.sum(dim=3).permute(1, 2, 0, 3, 4).reshape(num_trees * n, heads, dim_v)
    return o.index_select(0, trees["nodes"]).to(query.dtype)
