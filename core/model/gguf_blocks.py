"""A GGUF file's own quantized blocks as a quantized target's layers, without widening the
model first.

GGUF's Q4_1 block holds 32 weights as ``w = q * d + m`` (``q`` 0..15, ``d`` and ``m``
float16) and Q4_0 as ``w = (q - 8) * d``: exactly the groups of the 4-bit layers of
:mod:`specdec.model.quantization`, so the codes and scales are copied as they are. The token embedding (and an untied
output matrix), stored Q8_0 / F16 / F32, is widened a few thousand rows at a time and
rounded to int8 per row as :func:`~specdec.model.quantization.quantize_rows_int8` rounds the whole
float32 matrix, so its float32 copy (113 MB for the embedded model) never exists. Tensors
are read with plain file reads: a memory map's touched pages would count in the process's
resident memory for as long as it is open. Only llama-architecture files are mapped here
(tensor names ``blk.N.attn_q`` ... ``ffn_down``, ``token_embd``, ``output``; the query and
key rows are un-permuted as transformers' GGUF loader does, a row order only); other
layers, types and architectures are quantized from the weights transformers loaded.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import torch

from .quantization import GROUP_SIZE, Int8Embedding, layer_classes, quantize_rows_int8, release_freed_memory

_LLAMA_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
#: GGML tensor types taken as they are, and the bytes of one 32-weight block of each.
_BLOCK_TYPES = {2: ("Q4_0", 18), 3: ("Q4_1", 20)}
#: GGML tensor types an int8 matrix is rounded from, and the bytes of one 32-weight block of each.
_WIDE_TYPES = {0: ("F32", 128), 1: ("F16", 64), 8: ("Q8_0", 34)}
#: names of GGML tensor types, for messages.
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
               18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 30: "BF16"}
#: the 4-bit schemes whose blocks specdec's 4-bit layers take as they are.
TAKEN_SCHEMES = tuple(name for name, _ in _BLOCK_TYPES.values())
#: rows of an embedding widened to float32 at a time.
_ROWS_AT_A_TIME = 4096
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


def _read(f, offset: int, rows: int, width: int) -> np.ndarray:
    """``rows`` rows of ``width`` bytes from ``offset`` of the open file ``f``."""
    f.seek(offset)
    return np.frombuffer(f.read(rows * width), dtype=np.uint8).reshape(rows, width)


def _widen(kind: str, raw: np.ndarray) -> torch.Tensor:
    """Rows of F32 / F16 / Q8_0 data -> float32 ``[rows, columns]`` (Q8_0: ``w = q * d``)."""
    if kind == "F32":
        return torch.from_numpy(raw.copy().view(np.float32))
    if kind == "F16":
        return torch.from_numpy(raw.copy().view(np.float16).astype(np.float32))
    blocks = raw.reshape(raw.shape[0], -1, 34)
    scale = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    return torch.from_numpy((blocks[..., 2:].copy().view(np.int8).astype(np.float32) * scale).reshape(raw.shape[0], -1))


def _int8_rows(f, ggml_type: int, offset: int, rows: int, columns: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An F32 / F16 / Q8_0 matrix rounded to int8 per row, :data:`_ROWS_AT_A_TIME` rows at a time."""
    kind, block_bytes = _WIDE_TYPES[ggml_type]
    width = columns // GROUP_SIZE * block_bytes
    codes, scale = torch.empty(rows, columns, dtype=torch.int8), torch.empty(rows)
    for start in range(0, rows, _ROWS_AT_A_TIME):
        count = min(_ROWS_AT_A_TIME, rows - start)
        codes[start:start + count], scale[start:start + count] = quantize_rows_int8(
            _widen(kind, _read(f, offset + start * width, count, width)))
    return codes, scale


def linear_schemes(gguf: Path) -> set[str]:
    """The GGML types of a llama file's linear layers (``blk.N.attn_q`` ... ``ffn_down``);
    empty for another architecture."""
    arch, tensors = _read_tensor_table(gguf)
    if arch != "llama":
        return set()
    return {_TYPE_NAMES.get(kind, f"type {kind}") for name, _, kind, _ in tensors
            if len(parts := name.split(".")) == 4 and parts[0] == "blk" and parts[2] in _LLAMA_NAMES}


def quantized_layers(gguf: Path, config, dtype: torch.dtype, mode: str = "int4") -> dict[str, torch.nn.Module]:
    """``{module name: layer}`` from a llama file's own blocks: a 4-bit layer of ``mode``
    (:func:`~specdec.model.quantization.layer_classes`) for each Q4_0 / Q4_1 linear layer, an
    :class:`Int8Embedding` for the token embedding and an int8 layer for an untied output
    matrix (F32, F16 or Q8_0)."""
    four_bit, eight_bit = layer_classes(mode)
    arch, tensors = _read_tensor_table(gguf)
    if arch != "llama":
        return {}
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    layers = {}
    with open(gguf, "rb") as f:
        for name, dims, kind, offset in tensors:
            (columns, *rest), parts = dims, name.split(".")
            rows = rest[0] if rest else 1
            if name in ("token_embd.weight", "output.weight") and kind in _WIDE_TYPES and columns % GROUP_SIZE == 0:
                codes, scale = _int8_rows(f, kind, offset, rows, columns)
                if name == "output.weight":
                    layers["lm_head"] = eight_bit(codes, scale, None, dtype)
                else:
                    layers["model.embed_tokens"] = Int8Embedding(codes, scale, dtype, config.pad_token_id)
                continue
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LLAMA_NAMES or kind not in _BLOCK_TYPES:
                continue
            block_name, block_bytes = _BLOCK_TYPES[kind]
            if columns % GROUP_SIZE:
                continue
            codes, scale, minimum = _decode(block_name, _read(f, offset, rows, columns // GROUP_SIZE * block_bytes))
            if parts[2] in heads:
                order = _unpermute_rows(rows, heads[parts[2]])
                codes, scale, minimum = codes[order], scale[order], minimum[order]
            layers[f"model.layers.{parts[1]}.{_LLAMA_NAMES[parts[2]]}"] = four_bit(codes, scale, minimum, None, dtype)
            release_freed_memory()  # a layer's temporaries, kept by the allocator, would add up to the weights' size
    return layers
