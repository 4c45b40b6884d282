"""A GGUF file's own quantized blocks as a quantized target's layers, without widening the
model first.

GGUF's Q4_1 block holds 32 weights as ``w = q * d + m`` (``q`` 0..15, ``d`` and ``m``
float16) and Q4_0 as ``w = (q - 8) * d``: exactly the groups of the 4-bit layers of
:mod:`specdec.model.quantization`, so the codes and scales are copied as they are. Q4_K's
super-block of 256 holds eight such groups whose scale and minimum are a float16 times a
6-bit integer: the same 4-bit layers with float32 scales, which hold those products
exactly. Q5_0 (``w = (q - 16) * d``), Q8_0 (``w = q * d``) and Q6_K (``w = (q - 32) * d *
s``, a scale per 16 weights) become 8-bit codes with a float32 scale per block
(:class:`~specdec.model.quantization.W8A8BlockLinear`): more bytes than the file, the same
weights. The token embedding (and an untied output matrix), stored Q8_0 / F16 / F32, is
widened a few thousand rows at a time and rounded to int8 per row as
:func:`~specdec.model.quantization.quantize_rows_int8` rounds the whole float32 matrix, so
its float32 copy (113 MB for the embedded model) never exists. Tensors are read with plain
file reads: a memory map's touched pages would count in the process's resident memory for
as long as it is open. Llama and Gemma 3 files are mapped here (tensor names
``blk.N.attn_q`` ... ``ffn_down``, ``token_embd``, ``output``; a llama file's query and key
rows are un-permuted as transformers' GGUF loader does, a row order only); other layers,
types and architectures are quantized from the weights transformers loaded.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np
import torch

from .quantization import (
    GROUP_SIZE,
    Int8Embedding,
    W8A8BlockLinear,
    layer_classes,
    quantize_rows_int8,
    release_freed_memory,
)

_LINEAR_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
#: architectures whose linear layers are mapped, and whether their query and key rows are
#: stored permuted for rotary embeddings (llama.cpp's converter permutes llama's only).
_ARCHITECTURES = {"llama": True, "gemma3": False}
#: GGML tensor types taken as they are: name, bytes and weights of one block.
_BLOCK_TYPES = {2: ("Q4_0", 18, 32), 3: ("Q4_1", 20, 32), 12: ("Q4_K", 144, 256),
                6: ("Q5_0", 22, 32), 8: ("Q8_0", 34, 32), 14: ("Q6_K", 210, 256)}
#: the block types that become 4-bit layers; the others become 8-bit block layers.
_FOUR_BIT = ("Q4_0", "Q4_1", "Q4_K")
#: GGML tensor types an int8 matrix is rounded from, and the bytes of one 32-weight block of each.
_WIDE_TYPES = {0: ("F32", 128), 1: ("F16", 64), 8: ("Q8_0", 34)}
#: names of GGML tensor types, for messages.
_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
               11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS",
               18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 30: "BF16"}


def taken_schemes(mode: str) -> tuple[str, ...]:
    """The GGUF block types a quantization mode takes as they are: every type of
    :data:`_BLOCK_TYPES` on the integer-dot kernels (``w4a8``), Q4_0 and Q4_1 on torch's int4
    kernel (``int4``), none in an 8-bit mode."""
    return {"w4a8": tuple(name for name, _, _ in _BLOCK_TYPES.values()), "int4": ("Q4_0", "Q4_1")}.get(mode, ())
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


def _half(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 bytes ``[..., 2]`` -> float32 ``[...]``."""
    return raw.copy().view(np.float16)[..., 0].astype(np.float32)


def _decode(kind: str, raw: np.ndarray, width: int) -> tuple[torch.Tensor, ...]:
    """Rows of ``kind`` blocks -> a 4-bit type's ``(codes [rows, in] 0..15, scale, minimum
    [rows, in/32])`` or an 8-bit type's ``(codes [rows, in] int8, scales [rows, in/32 or in/16])``,
    float32, the weights llama.cpp's dequantization gives (``width``: bytes of a block)."""
    b = raw.reshape(raw.shape[0], -1, width)
    rows = raw.shape[0]
    tensor = lambda a, dtype=None: torch.from_numpy(np.ascontiguousarray(a if dtype is None else a.astype(dtype)))  # noqa: E731
    if kind in ("Q4_0", "Q4_1"):
        scale = _half(b[..., 0:2])
        minimum = _half(b[..., 2:4]) if kind == "Q4_1" else -8 * scale
        packed = b[..., width - 16:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], -1)  # low nibbles are weights 0..15, high 16..31
        return tensor(codes.reshape(rows, -1)), tensor(scale), tensor(minimum)
    if kind == "Q8_0":
        return tensor(b[..., 2:].view(np.int8).reshape(rows, -1)), tensor(_half(b[..., 0:2]))
    if kind == "Q5_0":
        qh = b[..., 2:6].copy().view(np.uint32)  # [rows, blocks, 1]
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
        qs = b[..., 6:22]
        codes = np.concatenate([qs & 0x0F, qs >> 4], -1) | high
        return tensor(codes.astype(np.int16).reshape(rows, -1) - 16, np.int8), tensor(_half(b[..., 0:2]))
    if kind == "Q4_K":
        d, dmin, sm, qs = _half(b[..., 0:2]), _half(b[..., 2:4]), b[..., 4:16].astype(np.uint8), b[..., 16:144]
        sc = np.concatenate([sm[..., 0:4] & 63, (sm[..., 8:12] & 0x0F) | ((sm[..., 0:4] >> 6) << 4)], -1)
        mn = np.concatenate([sm[..., 4:8] & 63, (sm[..., 8:12] >> 4) | ((sm[..., 4:8] >> 6) << 4)], -1)
        q = qs.reshape(rows, -1, 4, 32)  # chunk c: low nibbles are group 2c, high nibbles group 2c + 1
        codes = np.stack([q & 0x0F, q >> 4], 3).reshape(rows, -1)
        scale = d[..., None] * sc.astype(np.float32)  # float16 times a 6-bit integer: exact in float32
        minimum = -(dmin[..., None] * mn.astype(np.float32))
        return tensor(codes), tensor(scale.reshape(rows, -1)), tensor(minimum.reshape(rows, -1))
    # Q6_K: per half of 128 weights, ql[64] qh[32]; then 16 int8 scales and a float16 d
    ql = b[..., 0:128].reshape(rows, -1, 2, 64)
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    high = ((qh >> shifts) & 3) << 4  # [rows, blocks, half, 4, 32]: quarters 0..3
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], 3)
    codes = (low | high).astype(np.int16) - 32
    sc = b[..., 192:208].view(np.int8).astype(np.float32)
    scales = _half(b[..., 208:210])[..., None] * sc  # float16 times an int8: exact in float32
    return tensor(codes.reshape(rows, -1), np.int8), tensor(scales.reshape(rows, -1))


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
    codes, scales = _decode("Q8_0", raw, 34)
    return codes.float() * scales.repeat_interleave(32, 1)


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


def _linear_tensor(name: str) -> tuple[int, str] | None:
    """``(layer index, module name inside the layer)`` of a linear layer's tensor name, or None."""
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LINEAR_NAMES:
        return int(parts[1]), _LINEAR_NAMES[parts[2]]
    return None


def linear_schemes(gguf: Path) -> set[str]:
    """The GGML types of a llama or Gemma 3 file's linear layers (``blk.N.attn_q`` ...
    ``ffn_down``); empty for another architecture. Read once per version of the file: every
    ``LLM`` of a GGUF model asks, and reading walks the header of every tensor."""
    stat = Path(gguf).stat()
    return set(_linear_schemes(str(gguf), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=8)
def _linear_schemes(path: str, mtime_ns: int, size: int) -> frozenset[str]:
    arch, tensors = _read_tensor_table(Path(path))
    if arch not in _ARCHITECTURES:
        return frozenset()
    return frozenset(_TYPE_NAMES.get(kind, f"type {kind}") for name, _, kind, _ in tensors if _linear_tensor(name))


def quantized_layers(gguf: Path, config, dtype: torch.dtype, mode: str = "int4") -> dict[str, torch.nn.Module]:
    """``{module name: layer}`` from a llama or Gemma 3 file's own blocks: for each linear
    layer whose type ``mode`` takes (:func:`taken_schemes`), a 4-bit layer of ``mode``
    (:func:`~specdec.model.quantization.layer_classes`) or an 8-bit block layer; an
    :class:`Int8Embedding` for the token embedding and an int8 layer for an untied output
    matrix (F32, F16 or Q8_0)."""
    four_bit, eight_bit = layer_classes(mode)
    arch, tensors = _read_tensor_table(gguf)
    if arch not in _ARCHITECTURES:
        return {}
    taken = taken_schemes(mode)
    heads = {"self_attn.q_proj": config.num_attention_heads, "self_attn.k_proj": config.num_key_value_heads}
    layers = {}
    with open(gguf, "rb") as f:
        for name, dims, kind, offset in tensors:
            columns, rows = dims[0], (dims[1] if len(dims) > 1 else 1)
            if name in ("token_embd.weight", "output.weight") and kind in _WIDE_TYPES and columns % GROUP_SIZE == 0:
                codes, scale = _int8_rows(f, kind, offset, rows, columns)
                if name == "output.weight":
                    layers["lm_head"] = eight_bit(codes, scale, None, dtype)
                else:
                    layers["model.embed_tokens"] = Int8Embedding(codes, scale, dtype, config.pad_token_id)
                continue
            linear = _linear_tensor(name)
            if linear is None or kind not in _BLOCK_TYPES or _BLOCK_TYPES[kind][0] not in taken:
                continue
            block_name, block_bytes, block_weights = _BLOCK_TYPES[kind]
            if columns % block_weights:
                continue
            raw = _read(f, offset, rows, columns // block_weights * block_bytes)
            parts = list(_decode(block_name, raw, block_bytes))
            if _ARCHITECTURES[arch] and linear[1] in heads:
                order = _unpermute_rows(rows, heads[linear[1]])
                parts = [t[order] for t in parts]
            if block_name == "Q4_K":  # w4a8 only: float32 scales
                layer = four_bit(*parts, None, dtype, torch.float32)
            elif block_name in _FOUR_BIT:
                layer = four_bit(*parts, None, dtype)
            else:
                layer = W8A8BlockLinear(*parts, None, dtype)
            layers[f"model.layers.{linear[0]}.{linear[1]}"] = layer
            release_freed_memory()  # a layer's temporaries, kept by the allocator, would add up to the weights' size
    return layers
