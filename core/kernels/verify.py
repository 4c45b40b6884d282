"""Batched verification (torch reference of the Triton kernels, same arguments and results).

Rows of ``target``/``p``: per request, the root's row then one row per draft node, packed
from ``row_start[b]``; nodes are packed from ``node_start[b]``.
"""

from __future__ import annotations

import torch


def greedy_tree_verify_torch(target_tokens, tokens, parents, row_start, node_start, num_nodes, max_nodes, max_depth):
    """Returns ``(path [B, max_depth] (-1 padded), num_accepted [B], bonus [B])``."""
    batch = num_nodes.numel()
    path = torch.full((batch, max(max_depth, 1)), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    bonus = torch.zeros(batch, dtype=target_tokens.dtype)
    target, toks, pars = target_tokens.tolist(), tokens.tolist(), parents.tolist()
    for b in range(batch):
        r0, n0, n = int(row_start[b]), int(node_start[b]), int(num_nodes[b])
        cur, depth = -1, 0
        while depth < max_depth:
            want = target[r0 + cur + 1]
            child = next((k for k in range(n) if pars[n0 + k] == cur and toks[n0 + k] == want), None)
            if child is None:
                break
            path[b, depth] = child
            cur, depth = child, depth + 1
        accepted[b] = depth
        bonus[b] = target[r0 + cur + 1]
    return path, accepted, bonus


def chain_rejection_torch(p, q, tokens, u_accept, u_sample, row_start, node_start, num_draft, one_hot, max_k):
    """Rejection sampling of chains with given uniforms. Returns ``(num_accepted [B], token [B])``.

    Draft ``k`` is accepted iff ``u_accept * q(x) < p(x)`` (q one-hot where ``one_hot``);
    the token is drawn by inverse CDF with ``u_sample`` from norm(max(0, p - q)) at the
    first rejection, else from the row after the last draft.
    """
    batch = num_draft.numel()
    accepted = torch.zeros(batch, dtype=torch.int32)
    out = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        r0, n0, n = int(row_start[b]), int(node_start[b]), int(num_draft[b])
        a = n
        for k in range(n):
            x = int(tokens[n0 + k])
            qx = 1.0 if one_hot[b] else float(q[n0 + k, x])
            if not float(u_accept[n0 + k]) * qx < float(p[r0 + k, x]):
                a = k
                break
        row = p[r0 + a].float()
        if a < n:
            if one_hot[b]:
                qrow = torch.zeros_like(row)
                qrow[int(tokens[n0 + a])] = 1.0
            else:
                qrow = q[n0 + a].float()
            residual = torch.clamp(row - qrow, min=0.0)
            if residual.sum() > 0:
                row = residual
        cdf = torch.cumsum(row, 0)
        token = int(torch.searchsorted(cdf, float(u_sample[b]) * cdf[-1], right=True))
        accepted[b] = a
        out[b] = min(token, row.numel() - 1)
    return accepted, out
