"""4-bit and 8-bit weights multiplied with 8-bit activations by integer dot products
(``int8_dot.cpp``), and the torch reference whose bits the kernel equals.

Each token's activations are quantized on their own in blocks of :data:`BLOCK` columns
(``a = round(x * 127 / amax)``, scale ``amax / 127``, llama.cpp's Q8 blocks), each block's
dot product with a weight row is an exact integer, and the float work after it runs in a
fixed order per output (see the C++ file). So a token's outputs do not depend on the rows
beside it, and the kernel, built for AVX-512 VNNI or AVX2, equals :func:`q4_linear_reference`
and :func:`q8_linear_reference` exactly: greedy speculative output stays the quantized
target's plain output. Why a kernel of our own: torch's packed int4 and int8 kernels cost
nearly a decode's time for every extra row of a verification step; integer dot products
over 8-bit activations keep the extra rows nearly free, as in llama.cpp.

Weights are stored in groups of :data:`GROUP` output rows laid out for the kernel
(:func:`pack_q4`, :func:`pack_q8`, :func:`pack_q8b`); 4-bit blocks carry a scale ``d`` and
minimum ``m`` (``w = q * d + m``, GGUF's Q4_1; Q4_0 is ``m = -8 d``), float16 as in those
files or float32 (Q4_K's sub-block products); 8-bit rows one float32 scale, or 8-bit blocks
a float32 scale per 32 or per 16 columns (GGUF's Q5_0 and Q8_0, and Q6_K, as they are).
"""

from __future__ import annotations

import functools

import torch

from . import cpu

#: input columns per activation scale and per 4-bit weight scale
BLOCK = 32
#: output rows per interleaved weight group
GROUP = 16


@functools.cache
def kernel_available() -> bool:
    """Whether the integer-dot kernels are built here (they need AVX2 and F16C); builds
    them at the first call and tells torch.compile their output shapes."""
    if not (cpu.kernel_available() and hasattr(torch.ops.specdec_cpu, "q4_linear")):
        return False
    for name in ("q4_linear", "q8_linear", "q8b_linear"):
        torch.library.register_fake(f"specdec_cpu::{name}", _output_like)
    return True


def require_kernel() -> None:
    """Build the kernels, or raise naming what is missing."""
    if not kernel_available():
        raise RuntimeError("specdec's integer-dot CPU kernels are not available here: they need a C++ compiler "
                           "(see the warning logged) and a CPU with AVX2 and F16C; quantization int4 or int8 "
                           "runs on torch's own kernels")


def _output_like(x, packed, scales, n, bias):
    return x.new_empty(*x.shape[:-1], n)


def _groups(rows: int) -> int:
    return -(-rows // GROUP)


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` with zero rows appended up to ``rows``."""
    return t if t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def pack_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
            scale_dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` ``[N, K]`` in 0..15, ``d`` and ``m`` ``[N, K / 32]`` (rounded to ``scale_dtype``,
    float16 or float32) -> the kernel's ``(packed [N/16, 8K] uint8, dm [N/16, K/32 * 32])``:
    per group and block, four 64-byte chunks whose byte ``4r + i`` holds row ``r``'s codes of
    columns ``8c + i`` (low nibble) and ``8c + 4 + i`` (high nibble); then the block's 16
    ``d`` and 16 ``m``."""
    n, k = codes.shape
    groups, blocks = _groups(n), k // BLOCK
    q = _padded(codes.to(torch.uint8), groups * GROUP).view(groups, GROUP, blocks, 4, 2, 4)
    q = q.permute(0, 2, 3, 1, 5, 4)  # group, block, chunk, row, i, nibble
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(groups, -1).contiguous()
    dm = torch.stack([_padded(d.to(scale_dtype), groups * GROUP).view(groups, GROUP, blocks),
                      _padded(m.to(scale_dtype), groups * GROUP).view(groups, GROUP, blocks)], 1)
    return packed, dm.permute(0, 3, 1, 2).reshape(groups, -1).contiguous()


def pack_q8(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` ``[N, K]`` int8, ``scale`` ``[N]`` -> the kernel's ``(packed [N/16, 16K]
    uint8, scale [N/16 * 16] float32)``: per group and block, eight 64-byte chunks whose byte
    ``4r + i`` holds row ``r``'s code of column ``4c + i``, plus 128."""
    n, k = codes.shape
    groups, blocks = _groups(n), k // BLOCK
    q = (_padded(codes, groups * GROUP).to(torch.int16) + 128).to(torch.uint8)
    packed = q.view(groups, GROUP, blocks, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, -1).contiguous()
    return packed, _padded(scale.float(), groups * GROUP).contiguous()


def pack_q8b(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``codes`` ``[N, K]`` int8, ``scales`` ``[N, K/32]`` or ``[N, K/16]`` (one scale per
    32 or per 16 columns) -> the kernel's ``(packed, scales [N/16, K/32 * subs * 16]
    float32)``: :func:`pack_q8`'s codes, then per group and block the ``subs`` runs of 16
    rows' scales."""
    n, k = codes.shape
    groups, blocks = _groups(n), k // BLOCK
    subs = scales.shape[1] // blocks
    packed, _ = pack_q8(codes, torch.ones(n))
    s = _padded(scales.float(), groups * GROUP).view(groups, GROUP, blocks, subs)
    return packed, s.permute(0, 2, 3, 1).reshape(groups, -1).contiguous()


def unpack_q8b_scales(scales: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """The scales of rows ``ids`` (any shape) of :func:`pack_q8b`'s layout: ``[*ids.shape, K/32 * subs]``."""
    groups, blocks = scales.shape[0], k // BLOCK
    s = scales.view(groups, blocks, -1, GROUP)
    flat = ids.reshape(-1)
    return s[flat // GROUP, :, :, flat % GROUP].reshape(*ids.shape, -1)


def unpack_q4(packed: torch.Tensor, dm: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`pack_q4`'s inverse: ``(codes [n, K] uint8, d [n, K/32], m [n, K/32])`` in ``dm``'s dtype."""
    groups = packed.shape[0]
    blocks = packed.shape[1] // (GROUP * BLOCK // 2)
    q = packed.view(groups, blocks, 4, GROUP, 4)
    q = torch.stack([q & 0x0F, q >> 4], -1).permute(0, 3, 1, 2, 5, 4)  # group, row, block, chunk, nibble, i
    dm = dm.view(groups, blocks, 2, GROUP).permute(2, 0, 3, 1).reshape(2, groups * GROUP, blocks)
    return q.reshape(groups * GROUP, -1)[:n], dm[0, :n], dm[1, :n]


def unpack_q8_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The int8 codes of rows ``ids`` (any shape) of :func:`pack_q8`'s layout: ``[*ids.shape, K]``."""
    groups = packed.shape[0]
    q = packed.view(groups, -1, 8, GROUP, 4)
    flat = ids.reshape(-1)
    rows = q[flat // GROUP, :, :, flat % GROUP, :]  # [ids, blocks, chunk, i]
    return (rows.reshape(*ids.shape, -1).to(torch.int16) - 128).to(torch.int8)


def q4_linear(x: torch.Tensor, packed: torch.Tensor, dm: torch.Tensor, n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for packed 4-bit ``w`` ``[n, K]``, in ``x``'s dtype."""
    return torch.ops.specdec_cpu.q4_linear(x, packed, dm, n, bias)


def q8b_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for 8-bit ``w`` ``[n, K]`` packed with block scales, in ``x``'s dtype."""
    return torch.ops.specdec_cpu.q8b_linear(x, packed, scales, n, bias)


def q8_linear(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, n: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` for packed 8-bit ``w`` ``[n, K]``, in ``x``'s dtype."""
    return torch.ops.specdec_cpu.q8_linear(x, packed, scale, n, bias)


# -- the torch reference ----------------------------------------------------------------

def quantize_q8_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``x`` ``[T, K]`` -> ``(codes [T, K] int8, scales [T, K/32] float32, code sums [T, K/32] int32)``."""
    blocks = x.float().reshape(x.shape[0], x.shape[1] // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)
    # a tensor divided by a tensor: ``127.0 / amax`` would multiply by amax's reciprocal,
    # rounding twice where the kernel divides once
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[..., None]).to(torch.int32)
    return codes.to(torch.int8).reshape(x.shape), amax / 127.0, codes.sum(-1, dtype=torch.int32)


def _block_dots(codes: torch.Tensor, weight_codes: torch.Tensor) -> torch.Tensor:
    """Exact integer dot products ``[T, N, K/32]`` of every token's and row's blocks
    (float64 holds them exactly)."""
    (t, k), n = codes.shape, weight_codes.shape[0]
    a = codes.double().view(t, 1, k // BLOCK, BLOCK)
    w = weight_codes.double().view(1, n, k // BLOCK, BLOCK)
    return (a * w).sum(-1)


def q4_linear_reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                        scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """What :func:`q4_linear` computes, float32 ``[T, N]``, for ``w = codes * d + m`` with
    ``d``, ``m`` rounded to ``scale_dtype``: ``y = y + float(dot) * (d * s)``, then ``y = y +
    m * (s * sum(a))``, block by block."""
    a, s, sums = quantize_q8_reference(x)
    dots = _block_dots(a, codes).float()
    d, m = d.to(scale_dtype).float(), m.to(scale_dtype).float()
    sa = s * sums.float()
    y = torch.zeros(x.shape[0], codes.shape[0])
    for b in range(s.shape[1]):
        y = y + dots[:, :, b] * (d[None, :, b] * s[:, b, None])
        y = y + m[None, :, b] * sa[:, b, None]
    return y


def q8_linear_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """What :func:`q8_linear` computes, float32 ``[T, N]``, for ``w = codes * scale``:
    ``y = y + float(dot) * s`` block by block, then ``y * scale``."""
    a, s, _ = quantize_q8_reference(x)
    dots = _block_dots(a, codes).float()
    y = torch.zeros(x.shape[0], codes.shape[0])
    for b in range(s.shape[1]):
        y = y + dots[:, :, b] * s[:, b, None]
    return y * scale.float()[None]


def q8b_linear_reference(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """What :func:`q8b_linear` computes, float32 ``[T, N]``, for ``w = codes * d`` with one
    scale ``d`` per 32 or per 16 columns (``scales`` ``[N, K/32]`` or ``[N, K/16]``):
    ``y = y + float(dot) * (d * s)``, scale by scale."""
    a, s, _ = quantize_q8_reference(x)
    (t, k), n = a.shape, codes.shape[0]
    width = k // scales.shape[1]
    dots = (a.double().view(t, 1, -1, width) * codes.double().view(1, n, -1, width)).sum(-1).float()
    d = scales.float()
    y = torch.zeros(t, n)
    for u in range(scales.shape[1]):
        y = y + dots[:, :, u] * (d[None, :, u] * s[:, u * width // BLOCK, None])
    return y
