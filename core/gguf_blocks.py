"""A GGUF file's own 4-bit blocks as int4 linear layers, without widening them first.

GGUF's Q4_1 block holds 32 weights as ``w = q * d + m`` (``q`` 0..15, ``d`` and ``m``
float16) and Q4_0 as ``w = (q - 8) * d``: exactly :class:`~specdec.quantization.Int4Linear`'s
groups, so the codes and scales are copied as they are. Only llama-architecture files are
mapped here (tensor names ``blk.N.attn_q`` ... ``ffn_down``; the query and key rows are
un-permuted as transformers' GGUF loader does, a row order only); other layers, types and
architectures are quantized from the weights transformers loaded.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .quantization import GROUP_SIZE, Int4Linear

_LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}


def _decode(kind: str, raw: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q4_0 / Q4_1 blocks -> ``(codes [rows, in], scale, minimum [rows, in/32])``."""
    width = 20 if kind == "Q4_1" else 18
    blocks = raw.reshape(raw.shape[0], -1, width)
    scale = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    if kind == "Q4_1":
        minimum = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    else:
        minimum = -8 * scale
    packed = torch.from_numpy(blocks[..., width - 16:].copy())
    codes = torch.cat([packed & 0x0F, packed >> 4], -1)  # low nibbles are weights 0..15, high 16..31
    return codes.reshape(raw.shape[0], -1), scale, minimum


def _unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers' loader gives GGUF's rotary-permuted q/k matrices."""
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def int4_layers(gguf: Path, config, dtype: torch.dtype) -> dict[str, Int4Linear]:
    """``{module name: Int4Linear}`` for the file's Q4_0 / Q4_1 linear layers (llama files)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    arch = reader.fields.get("general.architecture")
    if arch is None or bytes(arch.parts[arch.data[0]]).decode() != "llama":
        return {}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    layers = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        kind = tensor.tensor_type.name
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_NAMES or kind not in ("Q4_0", "Q4_1"):
            continue
        codes, scale, minimum = _decode(kind, np.asarray(tensor.data))
        if codes.shape[1] % GROUP_SIZE:
            continue
        if parts[2] in heads:
            order = _unpermute_rows(codes.shape[0], heads[parts[2]])
            codes, scale, minimum = codes[order], scale[order], minimum[order]
        layers[f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"] = Int4Linear(codes, scale, minimum, None, dtype)
    return layers
