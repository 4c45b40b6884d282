"""Triton kernels. Each has a torch reference with the same interface (kernels/__init__.py
dispatches: Triton on CUDA, torch elsewhere); CPU tests run these under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# -- paged attention for verification -------------------------------------------------


@triton.jit
def _paged_attention_kernel(Q, K, V, O, block_tables, tree_mask, seq_of_token, new_index, starts, num_new, qpos,
                            stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh,
                            stride_bt, stride_tm, scale, softcap, window, rep, block_size, D, DV,
                            HAS_SOFTCAP: tl.constexpr, HAS_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    """One program per (query token, query head): online softmax over its sequence's keys,
    read through the block table; committed keys are all visible, new keys per the tree mask."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // rep
    seq = tl.load(seq_of_token + t)
    start = tl.load(starts + seq)
    total = start + tl.load(num_new + seq)
    first_new_row = t - tl.load(new_index + t)
    my_pos = tl.load(qpos + t)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + t * stride_qt + h * stride_qh + d, mask=d < D, other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], -1.0e30, tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for k0 in range(0, total, BLOCK_N):
        idx = k0 + tl.arange(0, BLOCK_N)
        valid = idx < total
        block = tl.load(block_tables + seq * stride_bt + idx // block_size, mask=valid, other=0)
        slot = block.to(tl.int64) * block_size + idx % block_size
        k = tl.load(K + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None] & (d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale
        if HAS_SOFTCAP:
            s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0)
        is_new = idx >= start
        j = idx - start
        sees = tl.load(tree_mask + t * stride_tm + j, mask=valid & is_new, other=0)
        visible = valid & ((idx < start) | (sees != 0))
        if HAS_WINDOW:
            key_pos = tl.where(is_new, tl.load(qpos + first_new_row + j, mask=valid & is_new, other=0), idx)
            visible = visible & (my_pos - key_pos < window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp(s - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(V + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :],
                    mask=valid[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(O + t * stride_ot + h * stride_oh + dv, out.to(O.dtype.element_ty), mask=dv < DV)


def paged_attention_triton(query, key_pool, value_pool, layout, scale, sliding_window=None, softcap=None):
    """Same contract as the torch reference: ``query [heads, T, dim]`` -> ``[T, heads, value_dim]``."""
    heads, tokens, dim = query.shape
    kv_heads, dim_v = key_pool.shape[1], value_pool.shape[2]
    kt = layout.kernel_tensors
    out = torch.empty(tokens, heads, dim_v, dtype=query.dtype, device=query.device)
    _paged_attention_kernel[(tokens, heads)](
        query, key_pool, value_pool, out, kt["block_tables"], kt["tree_mask"], kt["seq_of_token"], kt["new_index"],
        kt["starts"], kt["num_new"], layout.query_positions,
        query.stride(1), query.stride(0), key_pool.stride(0), key_pool.stride(1), value_pool.stride(0),
        value_pool.stride(1), out.stride(0), out.stride(1), kt["block_tables"].stride(0), kt["tree_mask"].stride(0),
        float(scale), float(softcap or 1.0), int(sliding_window or 0), heads // kv_heads, layout.block_size, dim, dim_v,
        HAS_SOFTCAP=softcap is not None, HAS_WINDOW=bool(sliding_window), BLOCK_N=32,
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_DV=triton.next_power_of_2(dim_v))
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
