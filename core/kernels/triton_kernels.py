"""Triton kernels. Each has a torch reference with the same interface (kernels/__init__.py
dispatches: Triton on CUDA, torch elsewhere); CPU tests run these under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# -- paged attention for verification -------------------------------------------------


@triton.jit
def _paged_attention_kernel(Q, K, V, O, M_part, L_part, O_part, block_tables, tree_mask, pending_mask, num_pending,
                            first_token, starts, num_new, tile_seq, tile_row, qpos, stride_qt, stride_qh, stride_ks,
                            stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_bt, stride_tm, stride_pm,
                            stride_ps, stride_pt, scale, softcap, window, rep, block_size, D, DV,
                            HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_PENDING: tl.constexpr,
                            SPLIT: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (tile of a sequence's query rows, KV head, split of its keys).

    A tile's rows are the sequence's new tokens times the query heads sharing this KV
    head, so each key block is read once for all of them and multiplied on the tensor
    cores (``tl.dot``); long contexts are cut in as many key splits as the launch has
    (whole key blocks, each sequence's own context divided evenly, so that a CUDA graph's
    fixed launch serves any context), whose partial softmax sums (``SPLIT``) the combine
    kernel adds; a split past a sequence's end stores an empty sum. Committed keys are all
    visible, new keys per the tree mask, except the last ``num_pending`` cached ones where
    ``HAS_PENDING`` (a draft tree's earlier levels): per the pending mask."""
    tile = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq + tile)
    start = tl.load(starts + seq)
    n_new = tl.load(num_new + seq)
    total = start + n_new
    committed = start  # keys every new token sees
    if HAS_PENDING:
        committed = start - tl.load(num_pending + seq)
    first = tl.load(first_token + seq)
    r = tl.load(tile_row + tile) + tl.arange(0, BLOCK_M)
    row_ok = r < n_new * rep
    tok = first + r // rep  # packed token of each row
    head = g * rep + r % rep
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    my_pos = tl.load(qpos + tok, mask=row_ok, other=0)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    split_len = tl.cdiv(tl.cdiv(total, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = split * split_len
    hi = tl.minimum(lo + split_len, total)
    for k0 in range(lo, hi, BLOCK_N):
        idx = k0 + tl.arange(0, BLOCK_N)
        valid = idx < hi
        block = tl.load(block_tables + seq * stride_bt + idx // block_size, mask=valid, other=0)
        slot = block.to(tl.int64) * block_size + idx % block_size
        k = tl.load(K + slot[None, :] * stride_ks + g * stride_kh + d[:, None],
                    mask=valid[None, :] & (d[:, None] < D), other=0.0).to(q.dtype)
        if DOT_F32:
            s = tl.dot(q, k, input_precision="ieee")
        else:
            s = tl.dot(q, k)
        s = s * scale
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        is_new = idx >= start
        j = idx - start
        sees = tl.load(tree_mask + tok[:, None] * stride_tm + j[None, :],
                       mask=row_ok[:, None] & (valid & is_new)[None, :], other=0)
        seen = (idx < committed)[None, :] | (sees != 0)
        if HAS_PENDING:
            is_pending = (idx >= committed) & (idx < start)
            pending_sees = tl.load(pending_mask + tok[:, None] * stride_pm + (idx - committed)[None, :],
                                   mask=row_ok[:, None] & (valid & is_pending)[None, :], other=0)
            seen = seen | (pending_sees != 0)
        visible = row_ok[:, None] & valid[None, :] & seen
        if HAS_WINDOW:
            key_pos = tl.where(is_new, tl.load(qpos + first + j, mask=valid & is_new, other=0), idx)
            visible = visible & (my_pos[:, None] - key_pos[None, :] < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slot[:, None] * stride_vs + g * stride_vh + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(q.dtype)
        if DOT_F32:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    if SPLIT:
        part = split * stride_ps + tok * stride_pt + head
        tl.store(M_part + part, m_i, mask=row_ok)
        tl.store(L_part + part, l_i, mask=row_ok)
        tl.store(O_part + part[:, None] * BLOCK_DV + dv[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / tl.where(row_ok, l_i, 1.0)[:, None]
        tl.store(O + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None] & (dv[None, :] < DV))


@triton.jit
def _combine_splits_kernel(M_part, L_part, O_part, O, num_splits, heads, stride_ps, stride_pt, stride_ot, stride_oh,
                           DV, BLOCK_DV: tl.constexpr):
    """out = sum_c exp(m_c - m) acc_c / sum_c exp(m_c - m) l_c over one (token, head)'s splits."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    dv = tl.arange(0, BLOCK_DV)
    base = t * stride_pt + h
    m = tl.load(M_part + base)
    for c in range(1, num_splits):
        m = tl.maximum(m, tl.load(M_part + c * stride_ps + base))
    acc = tl.zeros([BLOCK_DV], tl.float32)
    l_sum = tl.load(M_part + base) * 0.0
    for c in range(0, num_splits):
        w = tl.exp(tl.load(M_part + c * stride_ps + base) - m)
        l_sum += w * tl.load(L_part + c * stride_ps + base)
        acc += w * tl.load(O_part + (c * stride_ps + base) * BLOCK_DV + dv)
    tl.store(O + t * stride_ot + h * stride_oh + dv, (acc / l_sum).to(O.dtype.element_ty), mask=dv < DV)


#: the Triton interpreter (CPU tests) multiplies bfloat16 tiles wrongly (triton 3.9): dots in float32 there
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
#: keys per block of the paged attention's loop (a split is a whole number of them)
_BLOCK_N = 64
#: a key split is never shorter than this
_MIN_SPLIT = 256


@functools.cache
def _target_programs(device: torch.device) -> int:
    """Programs a launch should have to keep every multiprocessor busy: two per
    multiprocessor (264 on an H100; the same figure stands in under the interpreter)."""
    if device.type != "cuda":
        return 264
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def _attention_plan(layout, rep: int, kv_heads: int) -> dict:
    """Tiles of query rows and the number of key splits of one step's layout for
    ``kv_heads`` KV heads of ``rep`` query heads each (cached on the layout: every layer of
    the step uses the same). The splits are planned for the step's longest context, or for
    ``layout.context_bound`` where a CUDA graph fixes the launch for every context it replays."""
    key = ("paged_attention", rep, kv_heads)
    if key not in layout.kernel_cache:
        rows = [len(s.positions) * rep for s in layout.seqs]
        block_m = 16 if max(rows) <= 16 else 32 if max(rows) <= 32 else 64
        tile_seq, tile_row = [], []
        for i, n in enumerate(rows):
            for r0 in range(0, n, block_m):
                tile_seq.append(i)
                tile_row.append(r0)
        longest = layout.context_bound or max(s.start + len(s.positions) for s in layout.seqs)
        work = len(tile_seq) * kv_heads
        programs = _target_programs(torch.device(layout.device))
        splits = max(1, min(-(-programs // max(work, 1)), -(-longest // _MIN_SPLIT)))
        to = lambda x: torch.tensor(x, dtype=torch.int32, device=layout.device)  # noqa: E731
        layout.kernel_cache[key] = {"tile_seq": to(tile_seq), "tile_row": to(tile_row), "block_m": block_m,
                                    "splits": splits}
    return layout.kernel_cache[key]


def paged_attention_triton(query, key_pool, value_pool, layout, scale, sliding_window=None, softcap=None):
    """Same contract as the torch reference: ``query [heads, T, dim]`` -> ``[T, heads, value_dim]``,
    except pending draft nodes beside a sliding window (their keys' positions are not the
    cache's order), which only the reference attends."""
    heads, tokens, dim = query.shape
    kv_heads, dim_v = key_pool.shape[1], value_pool.shape[2]
    rep = heads // kv_heads
    kt = layout.kernel_tensors
    # without pending nodes the kernel reads neither: other int tensors stand in
    pending_mask, num_pending = ((kt["pending_mask"], kt["num_pending"]) if layout.has_pending
                                 else (kt["tree_mask"], kt["num_new"]))
    plan = _attention_plan(layout, rep, kv_heads)
    block_dv = max(16, triton.next_power_of_2(dim_v))
    out = torch.empty(tokens, heads, dim_v, dtype=query.dtype, device=query.device)
    splits = plan["splits"]
    if splits > 1:
        m_part = torch.empty(splits, tokens, heads, dtype=torch.float32, device=query.device)
        l_part = torch.empty_like(m_part)
        o_part = torch.empty(splits, tokens, heads, block_dv, dtype=torch.float32, device=query.device)
    else:
        m_part = l_part = o_part = out  # not read
    grid = (len(plan["tile_seq"]), kv_heads, splits)
    _paged_attention_kernel[grid](
        query, key_pool, value_pool, out, m_part, l_part, o_part, kt["block_tables"], kt["tree_mask"], pending_mask,
        num_pending, kt["first_token"], kt["starts"], kt["num_new"], plan["tile_seq"], plan["tile_row"],
        layout.query_positions, query.stride(1), query.stride(0), key_pool.stride(0), key_pool.stride(1),
        value_pool.stride(0), value_pool.stride(1), out.stride(0), out.stride(1), kt["block_tables"].stride(0),
        kt["tree_mask"].stride(0), pending_mask.stride(0), tokens * heads, heads, float(scale), float(softcap or 1.0),
        int(sliding_window or 0), rep, layout.block_size, dim, dim_v, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=bool(sliding_window), HAS_PENDING=layout.has_pending, SPLIT=splits > 1,
        DOT_F32=query.dtype == torch.float32 or _INTERPRETED, BLOCK_M=plan["block_m"],
        BLOCK_N=_BLOCK_N, BLOCK_D=max(16, triton.next_power_of_2(dim)), BLOCK_DV=block_dv)
    if splits > 1:
        _combine_splits_kernel[(tokens, heads)](m_part, l_part, o_part, out, splits, heads, tokens * heads, heads,
                                                out.stride(0), out.stride(1), dim_v, BLOCK_DV=block_dv)
    return out


@triton.jit
def _invariant_attention_kernel(Q, K, V, O, slots, key_pos, offset, count, qpos, stride_qt, stride_qh, stride_ks,
                                stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, scale, softcap, window, rep, D,
                                DV, HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (query token, query head) over the token's own key row, the first
    ``count`` columns, BLOCK_N at a time in column order: nothing in the arithmetic
    depends on the other tokens of the launch, so the result is that of decoding alone."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // rep
    base = tl.load(offset + t)
    n = tl.load(count + t)
    my_pos = tl.load(qpos + t)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    if not HAS_SOFTCAP:
        q = q * scale
    m_i = tl.max(tl.full([BLOCK_N], -1.0e30, tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for k0 in range(0, n, BLOCK_N):
        idx = k0 + tl.arange(0, BLOCK_N)
        valid = idx < n
        slot = tl.load(slots + base + idx, mask=valid, other=0).to(tl.int64)
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1)
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s * scale / softcap) - 1.0)
        visible = valid
        if HAS_WINDOW:
            visible = visible & (my_pos - tl.load(key_pos + base + idx, mask=valid, other=0) < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    tl.store(O + t * stride_ot + h * stride_oh + dv, (acc / l_i).to(O.dtype.element_ty), mask=dv < DV)


def invariant_attention_triton(query, key_pool, value_pool, layout, scale, sliding_window=None, softcap=None):
    """Same contract as :func:`specdec.kernels.invariant_attention.invariant_attention_torch` (the torch
    version, whose bits it does not promise to match: one mode uses one of the two)."""
    heads, tokens, dim = query.shape
    kv_heads, dim_v = key_pool.shape[1], value_pool.shape[2]
    rows = layout.invariant_key_rows
    out = torch.empty(tokens, heads, dim_v, dtype=query.dtype, device=query.device)
    _invariant_attention_kernel[(tokens, heads)](
        query, key_pool, value_pool, out, rows["slots"], rows["key_pos"], rows["offset"], rows["count"],
        layout.query_positions, query.stride(1), query.stride(0), key_pool.stride(0), key_pool.stride(1),
        value_pool.stride(0), value_pool.stride(1), out.stride(0), out.stride(1), float(scale), float(softcap or 1.0),
        int(sliding_window or 0), heads // kv_heads, dim, dim_v, HAS_SOFTCAP=softcap is not None,
        HAS_WINDOW=bool(sliding_window), BLOCK_N=32, BLOCK_D=triton.next_power_of_2(dim),
        BLOCK_DV=triton.next_power_of_2(dim_v))
    return out


# -- KV compaction ----------------------------------------------------------------------


@triton.jit
def _copy_rows_kernel(X, src, dst, num_pairs, row_elems, BLOCK: tl.constexpr):
    """Each program owns a column chunk and copies the pairs in order, so a row read later is
    never one an earlier pair overwrote (the engine passes an accepted path in order)."""
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < row_elems
    for i in range(0, num_pairs):
        s = tl.load(src + i).to(tl.int64)
        d = tl.load(dst + i).to(tl.int64)
        row = tl.load(X + s * row_elems + cols, mask=keep)
        tl.store(X + d * row_elems + cols, row, mask=keep)


def copy_rows_triton(pool, src, dst):
    """``pool[dst[i]] = pool[src[i]]`` for one pool (keys or values of one layer)."""
    row = pool[0].numel()
    block = min(1024, triton.next_power_of_2(row))
    _copy_rows_kernel[(triton.cdiv(row, block),)](pool, src, dst, src.numel(), row, BLOCK=block)


# -- verification ----------------------------------------------------------------------


@triton.jit
def _greedy_tree_kernel(target, tokens, parents, row_start, node_start, num_nodes, path, num_accepted, bonus,
                        stride_path, MAX_NODES: tl.constexpr, MAX_DEPTH: tl.constexpr):
    """Per request: follow the children whose token is the target's argmax of their parent's row."""
    b = tl.program_id(0)
    n = tl.load(num_nodes + b)
    r0 = tl.load(row_start + b)
    n0 = tl.load(node_start + b)
    k = tl.arange(0, MAX_NODES)
    valid = k < n
    tok = tl.load(tokens + n0 + k, mask=valid, other=-1)
    par = tl.load(parents + n0 + k, mask=valid, other=-2)
    cur = tl.max(tl.full([MAX_NODES], -1, tl.int32), axis=0)
    alive = cur == -1
    count = tl.sum(tl.zeros([MAX_NODES], tl.int32), axis=0)
    for depth in range(0, MAX_DEPTH):
        want = tl.load(target + r0 + cur + 1)
        hit = valid & (par == cur) & (tok == want) & alive
        child = tl.min(tl.where(hit, k, MAX_NODES), axis=0)
        found = child < MAX_NODES
        tl.store(path + b * stride_path + depth, child, mask=found)
        count = count + found.to(tl.int32)
        alive = alive & found
        cur = tl.where(found, child, cur)
    tl.store(num_accepted + b, count)
    tl.store(bonus + b, tl.load(target + r0 + cur + 1))


def greedy_tree_verify_triton(target_tokens, tokens, parents, row_start, node_start, num_nodes, max_nodes, max_depth):
    batch = num_nodes.numel()
    path = torch.full((batch, max(max_depth, 1)), -1, dtype=torch.int32, device=target_tokens.device)
    accepted = torch.empty(batch, dtype=torch.int32, device=target_tokens.device)
    bonus = torch.empty(batch, dtype=target_tokens.dtype, device=target_tokens.device)
    _greedy_tree_kernel[(batch,)](target_tokens, tokens, parents, row_start, node_start, num_nodes, path, accepted,
                                  bonus, path.stride(0), MAX_NODES=max(triton.next_power_of_2(max_nodes), 2),
                                  MAX_DEPTH=max_depth)
    return path, accepted, bonus


@triton.jit
def _residual_block(p_row, q_row, cols, vocab, flag, a, n, x_a):
    """p and max(0, p - q) on a block of the vocabulary; q is one-hot at ``x_a`` when ``flag``,
    and zero when no draft was rejected (``a == n``). Scalars are broadcast by adding them to
    a zero vector: the interpreter wants vector masks."""
    zero = cols * 0
    rejected = (zero + a) < n
    p = tl.load(p_row + cols, mask=cols < vocab, other=0.0)
    q = tl.load(q_row + cols, mask=(cols < vocab) & (zero + flag == 0) & rejected, other=0.0)
    q = tl.where((zero + flag != 0) & rejected & (cols == x_a), 1.0, q)
    return p, tl.maximum(p - q, 0.0)


@triton.jit
def _chain_rejection_kernel(P, Q, tokens, u_accept, u_sample, row_start, node_start, num_draft, one_hot,
                            num_accepted, out_token, vocab, MAX_K: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per request: accept draft k with min(1, p/q); at the first rejection sample from
    norm(max(0, p - q)), after full acceptance from the last row of p (inverse CDF)."""
    b = tl.program_id(0)
    n = tl.load(num_draft + b)
    r0 = tl.load(row_start + b)
    n0 = tl.load(node_start + b)
    flag = tl.load(one_hot + b)
    k = tl.arange(0, MAX_K)
    valid = k < n
    x = tl.load(tokens + n0 + k, mask=valid, other=0).to(tl.int64)
    px = tl.load(P + (r0 + k).to(tl.int64) * vocab + x, mask=valid, other=0.0)
    qx = tl.load(Q + (n0 + k).to(tl.int64) * vocab + x, mask=valid & (k * 0 + flag == 0), other=1.0)
    u = tl.load(u_accept + n0 + k, mask=valid, other=0.0)
    rejected = valid & (u * qx >= px)
    a = tl.min(tl.where(rejected, k, n), axis=0)
    has_rejection = a < n
    p_row = P + (r0 + a).to(tl.int64) * vocab
    q_row = Q + (n0 + a).to(tl.int64) * vocab
    x_a = tl.where(has_rejection, tl.load(tokens + n0 + tl.minimum(a, n - 1)), -1)
    total = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        p, residual = _residual_block(p_row, q_row, cols, vocab, flag, a, n, x_a)
        total += tl.sum(residual, axis=0)
    use_p = total <= 0.0  # p == q exactly: the residual is empty, fall back to p
    threshold = tl.load(u_sample + b) * tl.where(use_p, 1.0, total)
    running = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    below = tl.sum(tl.zeros([BLOCK_V], tl.int32), axis=0)
    for v0 in range(0, vocab, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        p, residual = _residual_block(p_row, q_row, cols, vocab, flag, a, n, x_a)
        r = tl.where((cols * 0.0 + total) <= 0.0, p, residual)
        below += tl.sum(((running + tl.cumsum(r, axis=0) <= threshold) & (cols < vocab)).to(tl.int32), axis=0)
        running += tl.sum(r, axis=0)
    tl.store(num_accepted + b, a)
    tl.store(out_token + b, tl.minimum(below, vocab - 1))


def chain_rejection_triton(p, q, tokens, u_accept, u_sample, row_start, node_start, num_draft, one_hot, max_k):
    batch = num_draft.numel()
    accepted = torch.empty(batch, dtype=torch.int32, device=p.device)
    token = torch.empty(batch, dtype=torch.int32, device=p.device)
    vocab = p.shape[-1]
    _chain_rejection_kernel[(batch,)](p, q, tokens, u_accept, u_sample, row_start, node_start, num_draft, one_hot,
                                      accepted, token, vocab, MAX_K=max(triton.next_power_of_2(max_k), 2),
                                      BLOCK_V=min(1024, triton.next_power_of_2(vocab)))
    return accepted, token
