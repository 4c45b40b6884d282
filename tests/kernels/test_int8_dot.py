"""The integer-dot kernels (4-bit and 8-bit weights, 8-bit activations): bit for bit their
torch reference, on AVX-512 VNNI and on AVX2; each token's outputs computed alone; the
layout's round trip."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from specdec.kernels import int8_dot
from specdec.model.quantization import (
    W4A8Linear,
    W8A8Linear,
    quantize_groups_int4,
    quantize_rows_int8,
    rows_are_independent,
)

pytestmark = pytest.mark.skipif(not int8_dot.kernel_available(), reason="the integer-dot kernels are not built here")

#: (outputs, inputs, tokens): a partial group of rows, one block, every token tile's tail
SHAPES = [(48, 64, 1), (40, 96, 3), (33, 32, 8), (64, 576, 9), (192, 576, 17), (20, 1536, 23)]


def _case(n: int, k: int, t: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g) * torch.rand(t, 1, generator=g) * 4
    x[0, :32] = 0  # a block of zeros (scale 0)
    x[-1, 5] = 1e4  # an outlier
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d = torch.rand(n, k // 32, generator=g) * 0.1
    m = -torch.rand(n, k // 32, generator=g) * 0.8
    w8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scale = torch.rand(n, generator=g) * 0.01
    return x, codes, d, m, w8, scale


def _block_scales(n: int, k: int, width: int, seed: int = 0) -> torch.Tensor:
    """Scales of ``width``-column blocks as GGUF's K-quants make them: a float16 super-block
    scale times a small integer, which float16 cannot always hold."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.rand(n, k // 256 if k % 256 == 0 else 1, generator=g) * 0.01).half().float()
    sub = torch.randint(-63, 64, (n, k // width), generator=g).float()
    return d.repeat_interleave(k // width // d.shape[1], 1) * sub


@pytest.mark.parametrize("n, k, t", SHAPES)
def test_kernels_equal_their_reference_bit_for_bit(n, k, t):
    x, codes, d, m, w8, scale = _case(n, k, t)
    got = torch.ops.specdec_cpu.quantize_q8(x)
    for a, b in zip(got, int8_dot.quantize_q8_reference(x)):
        assert torch.equal(a, b)
    packed, dm = int8_dot.pack_q4(codes, d, m)
    assert torch.equal(int8_dot.q4_linear(x, packed, dm, n), int8_dot.q4_linear_reference(x, codes, d, m))
    packed8, scale8 = int8_dot.pack_q8(w8, scale)
    assert torch.equal(int8_dot.q8_linear(x, packed8, scale8, n), int8_dot.q8_linear_reference(x, w8, scale))
    bias = torch.randn(n)
    assert torch.equal(int8_dot.q8_linear(x, packed8, scale8, n, bias),
                       int8_dot.q8_linear_reference(x, w8, scale) + bias)
    # bfloat16 in and out: the float32 result (bias added) rounded once, as torch rounds
    xb = x.bfloat16()
    assert torch.equal(int8_dot.q4_linear(xb, packed, dm, n, bias),
                       (int8_dot.q4_linear_reference(xb, codes, d, m) + bias).bfloat16())
    assert torch.equal(int8_dot.q8_linear(xb, packed8, scale8, n),
                       int8_dot.q8_linear_reference(xb, w8, scale).bfloat16())
    # and what the reference computes is the product of the dequantized weights, within the rounding
    wf = codes.float() * d.half().float().repeat_interleave(32, 1) + m.half().float().repeat_interleave(32, 1)
    exact = x @ wf.T
    assert (int8_dot.q4_linear(x, packed, dm, n) - exact).abs().max() <= 0.02 * exact.abs().max()


@pytest.mark.parametrize("n, k, t", SHAPES)
def test_block_scaled_kernels_equal_their_reference_bit_for_bit(n, k, t):
    """GGUF's other blocks as they are: 8-bit codes with a float32 scale per 32 columns
    (Q5_0, Q8_0) or per 16 (Q6_K), and 4-bit codes with float32 scales and minimums (Q4_K)."""
    x, codes, d, m, w8, _ = _case(n, k, t)
    for width in (32, 16):
        scales = _block_scales(n, k, width)
        packed, packed_scales = int8_dot.pack_q8b(w8, scales)
        want = int8_dot.q8b_linear_reference(x, w8, scales)
        assert torch.equal(int8_dot.q8b_linear(x, packed, packed_scales, n), want), width
        assert torch.equal(int8_dot.q8b_linear(x.bfloat16(), packed, packed_scales, n),
                           int8_dot.q8b_linear_reference(x.bfloat16(), w8, scales).bfloat16())
        exact = x @ (w8.float() * scales.repeat_interleave(width, 1)).T
        assert (want - exact).abs().max() <= 0.02 * exact.abs().max()
    d32, m32 = _block_scales(n, k, 32, seed=1).abs(), -_block_scales(n, k, 32, seed=2).abs()
    assert not torch.equal(d32.half().float(), d32)  # float16 would round these
    packed, dm = int8_dot.pack_q4(codes, d32, m32, torch.float32)
    assert torch.equal(int8_dot.q4_linear(x, packed, dm, n),
                       int8_dot.q4_linear_reference(x, codes, d32, m32, torch.float32))


def test_layout_round_trips():
    x, codes, d, m, w8, scale = _case(40, 96, 1)
    packed, dm = int8_dot.pack_q4(codes, d, m)
    c, d2, m2 = int8_dot.unpack_q4(packed, dm, 40)
    assert torch.equal(c, codes) and torch.equal(d2, d.half()) and torch.equal(m2, m.half())
    packed8, _ = int8_dot.pack_q8(w8, scale)
    ids = torch.tensor([[0, 17, 39], [5, 5, 16]])
    assert torch.equal(int8_dot.unpack_q8_rows(packed8, ids), w8[ids])
    for width in (32, 16):
        scales = _block_scales(40, 96, width)
        packed8, packed_scales = int8_dot.pack_q8b(w8, scales)
        assert torch.equal(int8_dot.unpack_q8_rows(packed8, ids), w8[ids])
        assert torch.equal(int8_dot.unpack_q8b_scales(packed_scales, ids, 96), scales[ids])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_token_is_computed_alone(dtype):
    """What lets a w4a8 / w8a8 target verify drafts losslessly: a token's outputs do not
    depend on the rows beside it (its activations are quantized on their own)."""
    weight = torch.randn(200, 576, generator=torch.Generator().manual_seed(1)) * 0.05
    assert rows_are_independent(W4A8Linear.from_weight(weight, None, dtype), 576, dtype, max_rows=40)
    assert rows_are_independent(W8A8Linear.from_weight(weight, torch.randn(200), dtype), 576, dtype, max_rows=40)


def test_layers_compute_their_dequantized_weights():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(96, 128, generator=g)
    x = torch.randn(5, 128, generator=g)
    four = W4A8Linear.from_weight(weight, None, torch.float32)
    codes, d, m = quantize_groups_int4(weight)
    deq = codes.float() * d.half().float().repeat_interleave(32, 1) + m.half().float().repeat_interleave(32, 1)
    assert torch.equal(four.weight, deq)
    assert torch.equal(four(x), int8_dot.q4_linear_reference(x, codes, d, m))
    eight = W8A8Linear.from_weight(weight, None, torch.float32)
    codes8, scale8 = quantize_rows_int8(weight)
    assert torch.equal(eight.weight, codes8.float() * scale8[:, None])
    assert torch.equal(eight(x), int8_dot.q8_linear_reference(x, codes8, scale8))
    exact = x @ weight.T  # 8-bit activations: about 1% of the largest output
    assert (eight(x) - exact).abs().max() <= 0.05 * exact.abs().max()


def test_the_avx2_build_computes_the_same_bits(tmp_path):
    """The kernel built for a CPU without VNNI (AVX2's 16-bit pair products, two 8-row
    halves a group) equals the reference too: a separate process builds it for Haswell
    (specdec's own build left out there, whose operators have the same names)."""
    script = textwrap.dedent("""
        import sys, torch
        from torch.utils.cpp_extension import load
        load(name="specdec_int8_dot_avx2", sources=[sys.argv[1]], build_directory=sys.argv[2],
             extra_cflags=["-O2", "-march=haswell"], is_python_module=False)
        sys.path.insert(0, sys.argv[3])
        from test_int8_dot import SHAPES, _block_scales, _case
        from specdec.kernels import int8_dot
        for n, k, t in SHAPES:
            x, codes, d, m, w8, scale = _case(n, k, t)
            w8[0, :4] = -128  # the sign trick's edge
            packed, dm = int8_dot.pack_q4(codes, d, m)
            assert torch.equal(torch.ops.specdec_cpu.q4_linear(x, packed, dm, n, None),
                               int8_dot.q4_linear_reference(x, codes, d, m)), (n, k, t)
            packed8, scale8 = int8_dot.pack_q8(w8, scale)
            assert torch.equal(torch.ops.specdec_cpu.q8_linear(x, packed8, scale8, n, None),
                               int8_dot.q8_linear_reference(x, w8, scale)), (n, k, t)
            for width in (32, 16):
                scales = _block_scales(n, k, width)
                packed8, packed_scales = int8_dot.pack_q8b(w8, scales)
                assert torch.equal(torch.ops.specdec_cpu.q8b_linear(x, packed8, packed_scales, n, None),
                                   int8_dot.q8b_linear_reference(x, w8, scales)), (n, k, t, width)
            d32, m32 = _block_scales(n, k, 32, seed=1).abs(), -_block_scales(n, k, 32, seed=2).abs()
            packed, dm = int8_dot.pack_q4(codes, d32, m32, torch.float32)
            assert torch.equal(torch.ops.specdec_cpu.q4_linear(x, packed, dm, n, None),
                               int8_dot.q4_linear_reference(x, codes, d32, m32, torch.float32)), (n, k, t)
        print("same bits")
    """)
    source = Path(int8_dot.__file__).with_suffix(".cpp")
    out = subprocess.run([sys.executable, "-c", script, str(source), str(tmp_path), str(Path(__file__).parent)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "SPECDEC_KERNELS": "torch"})
    assert out.returncode == 0 and "same bits" in out.stdout, out.stderr[-3000:]
