"""Batch-invariant attention, torch reference: a query's result depends on its own sequence only.

Attention runs in float32 over *key rows*: a query at position ``p`` sees the keys of
positions ``0..p`` at columns ``0..p``, as plain decoding lays them out (a draft tree's
ancestors compacted); rows are padded to a multiple of :data:`KEY_BLOCK` keys (scores and
softmax do not change with that padding), products have a multiple of
:data:`ROW_MULTIPLE` query rows (which the library treats alike), and the values are summed
:data:`KEY_BLOCK` keys at a time, the block sums added in order, so the reduction over keys
has a fixed length whatever the row's width. A draft tree's nodes are computed together
(:func:`_tree_attention`): their rows share the context, so its keys and values are
gathered once, not once per node, and all the step's trees run as one batch. The Triton
(CUDA) and C++ (CPU, :mod:`.cpu`) kernels read the same key rows and equal this reference
bit for bit; it serves where neither is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: key rows are padded to a multiple of this, and values are summed a block of this many
#: keys at a time (a fixed-length reduction), the blocks' sums added in order.
KEY_BLOCK = 64
#: rows of an attention product (queries times query heads per KV head) are padded to a
#: multiple of this (1-3 rows round differently from 4, 8 and 12 or more).
ROW_MULTIPLE = 4

def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (rows and key widths are padded so)."""
    return -(-n // multiple) * multiple


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
