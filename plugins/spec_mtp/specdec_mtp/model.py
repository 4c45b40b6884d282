"""DeepSeek-V3's multi-token prediction module, over any transformers target.

The module (tensors under ``model.layers.{N}.``, ``N`` the target's ``num_hidden_layers``,
as in DeepSeek-V3's checkpoints)::

    x  = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])   eh_proj: 2H -> H, no bias; embedding first
    y  = block(x)                                        one decoder layer of the target's architecture
    h' = shared_head.norm(y)                             the feature of the next draft step, and
    logits = shared_head.head(h')                        the target's LM head when the file has none

``h_0`` is the target's final normalised hidden state (the main model's output, as the
released checkpoints' own modeling code feeds it); deeper draft steps read ``h'`` of the
step before, which is normalised the same way. ``embed`` is the target's embedding (the
``embed_tokens`` copy DeepSeek-V3 stores with the module is not read). The block's
tensors sit directly under the module's prefix (``self_attn.*``, ``mlp.*``,
``input_layernorm``, ``post_attention_layernorm``; a MoE block's experts one by one,
``mlp.experts.{i}.gate_proj.weight``, though transformers stacks them in memory), next to
``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.*``.
"""

from __future__ import annotations

import copy
import re

import torch
from torch import nn

#: Names of the module's own tensors; every other tensor under its prefix is the block's.
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
#: Tensors every MTP module has (what a checkpoint without MTP layers lacks).
REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight")


class SharedHead(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Linear | None):
        super().__init__()
        self.norm = norm
        self.head = head


class MTPModule(nn.Module):
    """One MTP module. ``block`` is a decoder layer of the target's class; ``norm`` an
    example of the target's norm module (copied for enorm, hnorm and shared_head.norm)."""

    def __init__(self, block: nn.Module, norm: nn.Module, hidden_size: int, head: nn.Linear | None = None):
        super().__init__()
        self.enorm = copy.deepcopy(norm)
        self.hnorm = copy.deepcopy(norm)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(copy.deepcopy(norm), head)

    def forward(self, emb: torch.Tensor, feature: torch.Tensor, position_embeddings, position_ids: torch.Tensor,
                **attention_kwargs) -> torch.Tensor:
        """Rows ``[B, T, H]`` of token embeddings and features -> ``h'`` ``[B, T, H]``;
        ``attention_kwargs`` reach the block's attention (``specdec=meta`` at inference,
        ``unrolled=attend`` in training)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(feature)], dim=-1))
        out = self.block(x, attention_mask=None, position_ids=position_ids, position_embeddings=position_embeddings,
                         **attention_kwargs)
        out = out[0] if isinstance(out, tuple) else out
        return self.shared_head.norm(out)

    def layout_state(self) -> dict[str, torch.Tensor]:
        """The module's tensors under DeepSeek-V3's names (relative to ``model.layers.{N}.``),
        MoE experts one by one as checkpoints store them."""
        return split_experts({k.removeprefix("block."): v for k, v in self.state_dict().items()})

    def from_layout(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """DeepSeek-V3-named tensors -> this module's state-dict names (``embed_tokens`` dropped;
        per-expert matrices stacked the way the block's class holds them)."""
        own = self.state_dict()
        state = {(k if k.startswith(OWN) else "block." + k): v for k, v in state.items()
                 if not k.startswith("embed_tokens.")}
        return fuse_experts(state, own)


_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], own: dict) -> dict[str, torch.Tensor]:
    """Per-expert ``experts.{i}.{gate,up,down}_proj.weight`` -> transformers' stacked experts
    (``experts.gate_up_proj`` ``[E, 2I, H]``: gate rows then up rows; ``experts.down_proj``
    ``[E, H, I]``), for blocks whose class stacks them (``own``: its state dict)."""
    out, groups = {}, {}
    for key, value in state.items():
        m = _EXPERT.match(key)
        if m and f"{m[1]}.gate_up_proj" in own:
            groups.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = value
        else:
            out[key] = value
    for prefix, experts in groups.items():
        order = sorted(experts)
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([experts[i]["gate_proj"], experts[i]["up_proj"]])
                                                     for i in order])
        out[f"{prefix}.down_proj"] = torch.stack([experts[i]["down_proj"] for i in order])
    return out


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of :func:`fuse_experts`: stacked experts written one by one."""
    out = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj") and value.dim() == 3:
            prefix, half = key[:-len(".gate_up_proj")], value.shape[1] // 2
            for i, rows in enumerate(value):
                out[f"{prefix}.{i}.gate_proj.weight"], out[f"{prefix}.{i}.up_proj.weight"] = rows[:half], rows[half:]
        elif key.endswith("experts.down_proj") and value.dim() == 3:
            prefix = key[:-len(".down_proj")]
            for i, matrix in enumerate(value):
                out[f"{prefix}.{i}.down_proj.weight"] = matrix
        else:
            out[key] = value
    return out


def block_config(hf_config, attn_implementation: str):
    """A copy of the target's text config whose layers attend through ``attn_implementation``."""
    cfg = copy.deepcopy(hf_config)
    cfg._attn_implementation = attn_implementation
    return cfg


def build_module(parts, attn_implementation: str, own_head: bool = False) -> MTPModule:
    """An MTP module for the target of ``parts`` (:class:`specdec.model.target.TargetParts`):
    its decoder-layer class built like its last layer (so a MoE target gets a MoE block), the
    attention reading cache layer 0 of the module's own runner."""
    cfg = block_config(parts.hf_config, attn_implementation)
    last = parts.decoder_layers[-1]
    block = type(last)(cfg, layer_idx=parts.num_layers - 1)
    block.self_attn.layer_idx = 0
    norm = parts.final_norm if parts.final_norm is not None else getattr(last, "input_layernorm", None)
    if norm is None:
        raise TypeError(f"{type(last).__name__}: no norm module to copy for the MTP module's norms")
    head = nn.Linear(parts.hidden_size, parts.vocab_size, bias=False) if own_head else None
    return MTPModule(block, norm, parts.hidden_size, head)
