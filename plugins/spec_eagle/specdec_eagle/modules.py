"""The EAGLE draft heads, with the reference implementations' module and tensor names.

EAGLE-1/2 (``Eagle1Head``)::

    x = fc([embed(t_{i+1}); f_i])            fc: 2H -> H, with bias
    h = layers.0(x)                          a Llama decoder layer without its input norm
    logits = target.lm_head(h)               h regresses the target's normalised feature

EAGLE-3 (``Eagle3Head``)::

    f_i = fc([low_i; mid_i; high_i])          fc: 3H_target -> H, target features only
    a = [midlayer.input_layernorm(embed(t_{i+1})); midlayer.hidden_norm(f_i)]
    h = f_i + attn(a); h = h + mlp(post_attention_layernorm(h))
    logits = lm_head(norm(h))                 over the draft vocabulary; d2t maps back

For both, ``h`` (before any final norm) is the feature of the next draft step. The layer is
Llama-shaped whatever the target, as in every published EAGLE checkpoint; its rotary
embedding follows the head's config (the target's, for heads trained here).

Attention is pluggable: at inference it is the core's paged attention over the draft
runner's cache (:func:`specdec.drafting.runner.draft_attention`); in training it is
:func:`specdec.training.unrolled_attention`, which lets the unrolled steps of training-time test see what
the same draft steps see at inference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

#: ``attend(module, q [..., heads, T, d], k [..., kv, T, d], v [..., kv, T, d]) -> [..., T, heads, d]``
Attend = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def head_dim_of(cfg: LlamaConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class EagleAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, input_size: int):
        super().__init__()
        self.layer_idx = 0  # the draft runner's cache layer
        self.head_dim = head_dim_of(cfg)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads or cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated queries ``[..., heads, T, d]`` and keys, and values, of rows ``x [..., T, in]``."""
        shape = (*x.shape[:-1], -1, self.head_dim)
        q = self.q_proj(x).view(shape).transpose(-2, -3)
        k = self.k_proj(x).view(shape).transpose(-2, -3)
        v = self.v_proj(x).view(shape).transpose(-2, -3)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=-3)
        return q, k, v


class EagleMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class EagleDecoderLayer(nn.Module):
    """EAGLE-1's layer: a Llama decoder layer without ``input_layernorm``."""

    def __init__(self, cfg: LlamaConfig, attn_input: int):
        super().__init__()
        self.self_attn = EagleAttention(cfg, attn_input)
        self.mlp = EagleMLP(cfg)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        h = residual + self.self_attn.o_proj(attn_out)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3DecoderLayer(EagleDecoderLayer):
    """EAGLE-3's ``midlayer``: attention reads ``[input_layernorm(emb); hidden_norm(f)]``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__(cfg, 2 * cfg.hidden_size)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class EagleHead(nn.Module):
    """What both generations share: one draft step over rows of (token embedding, feature)."""

    generation: int

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        self.rotary_emb = LlamaRotaryEmbedding(config=cfg)
        self.embed_tokens: nn.Module | None = None  # the target's, unless the checkpoint has its own

    def to_serving(self, device: torch.device, dtype: torch.dtype) -> EagleHead:
        """Move to ``device`` and cast the weights to ``dtype``; the rotary frequencies stay
        float32 (a bfloat16 cast would round them)."""
        self.to(device)
        for name, child in self.named_children():
            if name != "rotary_emb":
                child.to(dtype)
        return self

    def rotary(self, positions: torch.Tensor, like: torch.Tensor):
        cos, sin = self.rotary_emb(like, positions.reshape(1, -1))
        return cos.view(*positions.shape, -1).to(like.dtype), sin.view(*positions.shape, -1).to(like.dtype)

    def fuse(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        """The feature of a row computed by the target, from its captured hidden states."""
        raise NotImplementedError

    def attention_input(self, emb: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention input, residual) of rows."""
        raise NotImplementedError

    def step(self, emb: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor, attend: Attend) -> torch.Tensor:
        """One draft step over rows ``[..., T]``: the next features ``[..., T, H]``."""
        x, residual = self.attention_input(emb, feature)
        attn = self.layer.self_attn
        cos, sin = self.rotary(positions, x)
        q, k, v = attn.qkv(x, cos, sin)
        out = attend(attn, q, k, v)
        return self.layer.finish(residual, out.reshape(*out.shape[:-2], -1))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (:attr:`draft_to_target` maps them)."""
        raise NotImplementedError

    #: ``[draft vocab]`` target id of each draft logit, or None (the target's vocabulary).
    draft_to_target: torch.Tensor | None = None


class Eagle1Head(EagleHead):
    generation = 1

    def __init__(self, cfg: LlamaConfig, fc_bias: bool = True):
        super().__init__(cfg)
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([EagleDecoderLayer(cfg, cfg.hidden_size)])
        #: the target's LM head, or its rows over the drafting vocabulary
        #: (:func:`specdec.drafting.checkpoint.restricted_head`)
        self.lm_head: nn.Module | None = None

    @property
    def layer(self) -> EagleDecoderLayer:
        return self.layers[0]

    def fuse(self, target_hidden):
        return target_hidden[0]

    def attention_input(self, emb, feature):
        x = self.fc(torch.cat([emb, feature], dim=-1))
        return x, x

    def logits(self, hidden):
        return self.lm_head(hidden)


class Eagle3Head(EagleHead):
    generation = 3

    def __init__(self, cfg: LlamaConfig, target_hidden: int, num_aux: int, draft_vocab: int, target_vocab: int):
        super().__init__(cfg)
        self.fc = nn.Linear(num_aux * target_hidden, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3DecoderLayer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, draft_vocab, bias=False)
        self.norm_before_residual = bool(getattr(cfg, "norm_before_residual", False))
        if draft_vocab != target_vocab:
            self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.long))
            self.register_buffer("t2d", torch.zeros(target_vocab, dtype=torch.bool))

    @property
    def layer(self) -> Eagle3DecoderLayer:
        return self.midlayer

    @property
    def draft_to_target(self):
        if not hasattr(self, "d2t"):
            return None
        return self.d2t + torch.arange(len(self.d2t), device=self.d2t.device)

    def set_draft_vocab(self, token_ids: torch.Tensor) -> None:
        """Store the draft vocabulary (sorted target ids) as the reference's ``d2t`` / ``t2d``."""
        self.d2t.copy_(token_ids - torch.arange(len(token_ids), device=token_ids.device))
        self.t2d.zero_()
        self.t2d[token_ids] = True

    def fuse(self, target_hidden):
        return self.fc(torch.cat(target_hidden, dim=-1))

    def attention_input(self, emb, feature):
        normed = self.midlayer.hidden_norm(feature)
        x = torch.cat([self.midlayer.input_layernorm(emb), normed], dim=-1)
        return x, normed if self.norm_before_residual else feature

    def logits(self, hidden):
        return self.lm_head(self.norm(hidden))
