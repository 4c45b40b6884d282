"""A GGUF file's own 4-bit blocks as int4 linear layers, without widening them first.

GGUF's Q4_1 block holds 32 weights as ``w = q * d + m`` (``q`` 0..15, ``d`` and ``m``
float16) and Q4_0 as ``w = (q - 8) * d``: exactly :class:`~specdec.quantization.Int4Linear`'s
groups, so the codes and scales are copied as they are. Only llama-architecture files are
mapped here (tensor names ``blk.N.attn_q`` ... ``ffn_down``; the query and key rows are
un-permuted as transformers' GGUF loader does, a row order only); other layers, types and
architectures are quantized from the weights transformers loaded.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from .quantization import GROUP_SIZE, Int4Linear

_LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
#: GGML tensor types taken as they are, and the bytes of one 32-weight block of each.
_BLOCK_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20)}
#: sizes of GGUF's scalar metadata value types (8 is a string, 9 an array).
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def _read_tensor_table(path: Path) -> tuple[str | None, list[tuple[str, list[int], int, int]]]:
    """``(general.architecture, [(name, dims, ggml type, absolute byte offset)])`` of a GGUF
    file. Read here rather than with the ``gguf`` package's reader, which turns every
    metadata value (the tokenizer's 49k strings among them) into arrays: 160 MB resident
    for the embedded model, more than its int4 weights."""
    with open(path, "rb") as f:
        u32 = lambda: struct.unpack("<I", f.read(4))[0]  # noqa: E731
        u64 = lambda: struct.unpack("<Q", f.read(8))[0]  # noqa: E731
        string = lambda: f.read(u64()).decode("utf-8", "replace")  # noqa: E731
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file")
        u32()  # version
        n_tensors, n_fields = u64(), u64()
        arch, alignment = None, 32
        for _ in range(n_fields):
            key, kind = string(), u32()
            if kind == 8:
                value = string()
                arch = value if key == "general.architecture" else arch
            elif kind == 9:
                item, count = u32(), u64()
                if item == 8:
                    for _ in range(count):
                        f.seek(u64(), 1)
                else:
                    f.seek(count * _SCALAR_BYTES[item], 1)
            else:
                raw = f.read(_SCALAR_BYTES[kind])
                if key == "general.alignment":
                    alignment = int.from_bytes(raw, "little")
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [u64() for _ in range(u32())]
            infos.append((name, dims, u32(), u64()))
        data_start = -(-f.tell() // alignment) * alignment
    return arch, [(name, dims, kind, data_start + offset) for name, dims, kind, offset in infos]


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
    arch, tensors = _read_tensor_table(gguf)
    if arch != "llama":
        return {}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    data = np.memmap(gguf, dtype=np.uint8, mode="r")
    layers = {}
    for name, dims, kind, offset in tensors:
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_NAMES or kind not in _BLOCK_TYPES:
            continue
        (columns, rows), (block_name, block_bytes) = dims, _BLOCK_TYPES[kind]
        if columns % GROUP_SIZE:
            continue
        width = columns // GROUP_SIZE * block_bytes
        codes, scale, minimum = _decode(block_name, data[offset:offset + rows * width].reshape(rows, width))
        if parts[2] in heads:
            order = _unpermute_rows(rows, heads[parts[2]])
            codes, scale, minimum = codes[order], scale[order], minimum[order]
        layers[f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"] = Int4Linear(codes, scale, minimum, None, dtype)
    return layers
