"""Attention of a step's new tokens over their sequences' paged K/V (torch reference)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from ..kvcache.layout import AttentionLayout


def paged_attention_torch(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                          layout: AttentionLayout, scale: float, sliding_window: int | None = None,
                          softcap: float | None = None) -> torch.Tensor:
    """Attention for a packed batch of new tokens.

    Args:
        query: ``[heads, T, dim]`` the new tokens of every sequence, packed.
        key_pool, value_pool: ``[slots, kv_heads, dim]`` one layer's cache (the new tokens
            already written).
        layout: where each sequence's keys are and which of them each query sees.
        scale: softmax scale. sliding_window: keys further back are hidden (Mistral,
            Gemma). softcap: tanh soft-capping of the scores (Gemma 2).

    Returns:
        ``[T, heads, value_dim]``.

    A batch of sequences attends one padded row per sequence, each over its own keys; one
    sequence, sliding windows, soft-capping and pending draft nodes use the packed dense
    mask (every query against the whole packed batch's keys, which costs ``T * S``).
    """
    if len(layout.seqs) > 1 and not layout.has_pending and sliding_window is None and softcap is None:
        return _padded_attention(query, key_pool, value_pool, layout, scale)
    k, v = gather_context(key_pool, value_pool, layout.context_slots)
    mask = layout.window_mask(sliding_window) if sliding_window else layout.dense_mask
    if softcap is None:
        return grouped_attention(query, k, v, mask, scale)
    rep = query.shape[0] // k.shape[0]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
    scores = torch.matmul(query, k.transpose(1, 2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).transpose(0, 1)


def gather_context(key_pool: torch.Tensor, value_pool: torch.Tensor,
                   slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values of ``slots`` (``[S]``) from one layer's pools, ``[kv_heads, S, dim]`` each."""
    return key_pool.index_select(0, slots).transpose(0, 1), value_pool.index_select(0, slots).transpose(0, 1)


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float) -> torch.Tensor:
    """``[heads, T, dim]`` queries over one sequence's (or a packed batch's) ``[kv_heads, S,
    dim]`` keys and values, ``mask [T, S]`` or None; ``[T, heads, value_dim]``. The query
    heads that share a KV head are folded into its rows (``[kv_heads, rep * T, dim]``): on
    the CPU ~4x faster than SDPA's ``enable_gqa`` path, and exact."""
    heads, tokens = query.shape[0], query.shape[1]
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    q = query.reshape(kv_heads, rep * tokens, query.shape[-1])
    m = None if mask is None else mask.repeat(rep, 1)[None, None]
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=m, scale=scale)[0]
    return out.reshape(heads, tokens, -1).transpose(0, 1)


def _padded_attention(query, key_pool, value_pool, layout: AttentionLayout, scale: float) -> torch.Tensor:
    """A batch of sequences on padded rows (:attr:`AttentionLayout.padded`): every query
    attends over its own sequence's keys only, not the whole packed batch's."""
    heads, tokens, dim = query.shape
    kv_heads = key_pool.shape[1]
    rep = heads // kv_heads
    out = query.new_empty(tokens, heads, value_pool.shape[-1])
    for pad in layout.padded:
        batch, rows, width = pad["mask"].shape
        k = key_pool.index_select(0, pad["slots"]).view(batch, width, kv_heads, -1).transpose(1, 2)
        v = value_pool.index_select(0, pad["slots"]).view(batch, width, kv_heads, -1).transpose(1, 2)
        # [heads, B * N, dim] -> [B, kv_heads, rep * N, dim]: the query heads sharing a KV head folded
        q = query.index_select(1, pad["queries"]).view(kv_heads, rep, batch, rows, dim)
        q = q.permute(2, 0, 1, 3, 4).reshape(batch, kv_heads, rep * rows, dim)
        mask = pad["mask"][:, None].expand(batch, rep, rows, width).reshape(batch, 1, rep * rows, width)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        o = o.view(batch, kv_heads, rep, rows, -1).permute(0, 3, 1, 2, 4).reshape(batch * rows, heads, -1)
        out.index_copy_(0, pad["tokens"], o.index_select(0, pad["rows"]))
    return out
