"""The CPU kernels under every shape users send and every argument they should refuse:
seeded sweeps against the torch references (row counts from 0 to 4096 with primes and every
tile tail, sizes growing and shrinking in one process, a fresh process whose first call is
large), and each entry point's checks, which raise a RuntimeError naming the kernel and the
shape instead of a signal that kills the process."""

import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import random_layout

from specdec.kernels import cpu, int8_dot
from specdec.kernels.attention import paged_attention_torch

pytestmark = pytest.mark.skipif(not int8_dot.kernel_available(), reason="the CPU kernels are not built here")

#: token counts of a step: zero (a prompt chunk that keeps no logits), decodes, every tail of
#: the 8-token tile, primes, the step budget's edge, and a long prompt's chunk; then smaller
#: again, so that buffers sized by a large call meet small ones and the other way round
ROWS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 97, 511, 512, 513, 601, 1021, 4096, 3, 0, 600, 1]


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    d, m = torch.rand(n, k // 32, generator=g) * 0.1, -torch.rand(n, k // 32, generator=g) * 0.8
    w8, scale = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8), torch.rand(n, generator=g) * 0.01
    return codes, d, m, w8, scale


def test_integer_dot_kernels_equal_their_reference_for_every_row_count():
    n, k = 40, 96  # a partial group of 16 rows, three blocks
    codes, d, m, w8, scale = _weights(n, k, 0)
    packed4, dm = int8_dot.pack_q4(codes, d, m)
    packed8, scale8 = int8_dot.pack_q8(w8, scale)
    bias = torch.randn(n)
    for i, rows in enumerate(ROWS):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(i)) * 3
        for dtype in (torch.float32, torch.bfloat16):
            xd = x.to(dtype)
            got4 = int8_dot.q4_linear(xd, packed4, dm, n, bias)
            want4 = (int8_dot.q4_linear_reference(xd, codes, d, m) + bias).to(dtype)
            got8 = int8_dot.q8_linear(xd, packed8, scale8, n)
            want8 = int8_dot.q8_linear_reference(xd, w8, scale).to(dtype)
            assert got4.shape == got8.shape == (rows, n)
            assert torch.equal(got4, want4) and torch.equal(got8, want8), f"{rows} rows, {dtype}"
        for a, b in zip(torch.ops.specdec_cpu.quantize_q8(x), int8_dot.quantize_q8_reference(x)):
            assert torch.equal(a, b), f"quantize_q8, {rows} rows"
    # leading dimensions of any shape, an empty one among them
    x = torch.randn(2, 0, k)
    assert int8_dot.q8_linear(x, packed8, scale8, n).shape == (2, 0, n)


@pytest.mark.skipif(not cpu.linear_kernel_available(), reason="the bfloat16 linear kernel needs AVX2 and FMA")
def test_the_bfloat16_linear_kernel_takes_every_row_count():
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(37, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(37, generator=g).bfloat16()
    for rows in ROWS:
        x = torch.randn(rows, 64, generator=g).bfloat16()
        got = cpu.kernel_linear(x, weight, bias)
        want = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
        assert got.shape == (rows, 37)
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.02)


#: (committed keys, new tokens, tree?) per sequence: decodes, prompt chunks crossing the 16-token
#: tile, trees, rows from 1 to 4096 keys, and a batch mixing a long prompt's chunk with decodes
ATTENTION_SWEEP = [
    [(0, 1, False)],
    [(0, 17, False)],
    [(4095, 1, False)],
    [(0, 600, False), (37, 1, False), (2000, 9, True), (5, 3, False)],
    [(3584, 512, False), (1, 1, False)],
    [(127, 16, True), (0, 2, False)],
    [(511, 2, False), (512, 1, False), (513, 31, False)],
]


@pytest.mark.skipif(not cpu.kernel_available(), reason="the attention kernel is not built here")
@pytest.mark.parametrize("shapes", ATTENTION_SWEEP, ids=str)
def test_invariant_attention_kernel_matches_the_reference_at_every_length(shapes):
    gen = torch.Generator().manual_seed(len(shapes))
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    blocks = sum(-(-(start + n) // bs) for start, n, _ in shapes) + 2
    layout = random_layout(gen, bs, blocks, shapes)
    keys = torch.randn(blocks * bs, kv_heads, dim, generator=gen).bfloat16()
    values = torch.randn(blocks * bs, kv_heads, dim, generator=gen).bfloat16()
    query = torch.randn(layout.num_tokens, heads, dim, generator=gen).bfloat16().transpose(0, 1)
    got = cpu.invariant_attention_cpu(query, keys, values, layout, dim ** -0.5)
    want = paged_attention_torch(query.float(), keys.float(), values.float(), layout, dim ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    # a step with no tokens (nothing scheduled for attention) is an empty result, not a fault
    empty = torch.ops.specdec_cpu.invariant_attention(
        torch.empty(0, heads, dim), keys, values, *[torch.empty(0, dtype=torch.long)] * 5, 0.125, 0.0, 0)
    assert empty.shape == (0, heads, dim)


def test_a_fresh_process_whose_first_call_is_large():
    """Per-thread buffers sized at the first call: a process whose first product has 4096
    rows, then one row, then 600, computes each as the reference does."""
    code = textwrap.dedent("""
        import torch
        from specdec.kernels import int8_dot
        int8_dot.require_kernel()
        g = torch.Generator().manual_seed(0)
        codes = torch.randint(0, 16, (64, 576), generator=g, dtype=torch.uint8)
        d, m = torch.rand(64, 18, generator=g) * 0.1, -torch.rand(64, 18, generator=g)
        packed, dm = int8_dot.pack_q4(codes, d, m)
        for rows in (4096, 1, 600, 0, 2):
            x = torch.randn(rows, 576, generator=g)
            assert torch.equal(int8_dot.q4_linear(x, packed, dm, 64), int8_dot.q4_linear_reference(x, codes, d, m))
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# -- every check of every entry point ---------------------------------------------------

def _q4(n=40, k=96):
    codes, d, m, _, _ = _weights(n, k, 1)
    return int8_dot.pack_q4(codes, d, m)


def _q8(n=40, k=96):
    _, _, _, w8, scale = _weights(n, k, 1)
    return int8_dot.pack_q8(w8, scale)


def _q8b(n=40, k=96, width=16):
    _, _, _, w8, _ = _weights(n, k, 1)
    return int8_dot.pack_q8b(w8, torch.rand(n, k // width))


INTEGER_DOT_REFUSALS = [
    ("q4_linear", lambda: int8_dot.q4_linear(torch.randn(3, 95), *_q4(), 40), r"q4_linear: x has 95 input features"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.zeros(3, 96, dtype=torch.int32), *_q4(), 40),
     "q4_linear: x must be float32 or bfloat16"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.randn(3, 64), *_q4(), 40), "q4_linear: dm must hold"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.randn(3, 96), _q4()[0], _q4()[1].double(), 40),
     "q4_linear: dm must hold float16 or float32"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.randn(3, 96), *_q4(), 60), "60 outputs in 3 groups"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.randn(3, 96), *_q4(), 40, torch.randn(7)),
     "the bias has 7 values for 40 outputs"),
    ("q4_linear", lambda: int8_dot.q4_linear(torch.tensor(1.0), *_q4(), 40), "at least one dimension"),
    ("q8_linear", lambda: int8_dot.q8_linear(torch.randn(3, 64), *_q8(), 40), "q8_linear: scale must hold|"
                                                                                "q8_linear: packed weights"),
    ("q8_linear", lambda: int8_dot.q8_linear(torch.randn(3, 96), _q8()[0], _q8()[1][:5], 40),
     "q8_linear: scale must hold one float32"),
    ("q8_linear", lambda: int8_dot.q8_linear(torch.randn(3, 96), _q8()[0].t(), _q8()[1], 40),
     "q8_linear: (packed weights|scale must hold)"),
    ("q8_linear", lambda: int8_dot.q8_linear(torch.randn(3, 0), *_q8(), 40), "q8_linear: x has 0 input features"),
    ("q8b_linear", lambda: int8_dot.q8b_linear(torch.randn(3, 96), _q8b()[0], _q8b()[1].flatten()[:7], 40),
     "q8b_linear: scales must hold one or two"),
    ("q8b_linear", lambda: int8_dot.q8b_linear(torch.randn(3, 96), _q8b()[0], _q8b()[1].half(), 40),
     "q8b_linear: scales must hold one or two float32"),
    ("q8b_linear", lambda: int8_dot.q8b_linear(torch.randn(3, 64), *_q8b(), 40), "q8b_linear: (scales|packed)"),
    ("q8b_linear", lambda: int8_dot.q8b_linear(torch.randn(3, 95), *_q8b(), 40), "q8b_linear: x has 95"),
    ("quantize_q8", lambda: torch.ops.specdec_cpu.quantize_q8(torch.randn(2, 3, 32)), "quantize_q8: x must be 2-D"),
    ("quantize_q8", lambda: torch.ops.specdec_cpu.quantize_q8(torch.randn(2, 33)), "quantize_q8: x has 33"),
]


@pytest.mark.parametrize("call, match", [(c, m) for _, c, m in INTEGER_DOT_REFUSALS],
                         ids=[f"{name}-{i}" for i, (name, _, _) in enumerate(INTEGER_DOT_REFUSALS)])
def test_integer_dot_kernels_refuse_bad_arguments_with_an_error(call, match):
    with pytest.raises(RuntimeError, match=match):
        call()


def _attention_args(**changes):
    """A valid call of the attention kernel (2 tokens over one row of 3 keys), then ``changes``."""
    args = dict(query=torch.randn(2, 4, 16), key_pool=torch.randn(8, 2, 16), value_pool=torch.randn(8, 2, 16),
                slots=torch.tensor([5, 1, 2]), key_pos=torch.tensor([0, 1, 2]), offset=torch.tensor([0, 0]),
                count=torch.tensor([2, 3]), query_pos=torch.tensor([1, 2]), scale=0.25, softcap=0.0, window=0)
    args.update(changes)
    return args


ATTENTION_REFUSALS = [
    (dict(key_pool=torch.randn(8, 0, 16), value_pool=torch.randn(8, 0, 16)), "not a positive multiple of 0 KV heads"),
    (dict(query=torch.randn(2, 3, 16)), "3 query heads are not a positive multiple of 2"),
    (dict(query=torch.randn(2, 4, 32)), "queries of dimension 32 against keys of 16"),
    (dict(query=torch.randn(2, 4, 16).double()), "query must be a contiguous float32"),
    (dict(query=torch.randn(4, 2, 16).transpose(0, 1)), "query must be a contiguous float32"),
    (dict(value_pool=torch.randn(8, 2, 16).bfloat16()), "key and value pools of one dtype"),
    (dict(value_pool=torch.randn(7, 2, 16)), "key and value pools must be"),
    (dict(key_pool=torch.randn(8, 2, 12), value_pool=torch.randn(8, 2, 12), query=torch.randn(2, 4, 12)),
     "must be positive multiples of"),
    (dict(count=torch.tensor([0, 3])), "token 0's key row \\[0, 0\\) is empty"),
    (dict(count=torch.tensor([2, 4])), "token 1's key row \\[0, 4\\) is empty or outside the 3 slots"),
    (dict(offset=torch.tensor([-1, 0])), "token 0's key row"),
    (dict(slots=torch.tensor([5, 1, 8])), "slot 8 is outside the pool's 8"),
    (dict(slots=torch.tensor([5, -1, 2])), "slot -1 is outside"),
    (dict(slots=torch.tensor([5, 1, 2], dtype=torch.int32)), "indices must be contiguous 1-D int64"),
    (dict(key_pos=torch.tensor([0, 1])), "3 slots but 2 key positions"),
    (dict(query_pos=torch.tensor([1])), "one entry per token \\(2\\)"),
]


@pytest.mark.skipif(not cpu.kernel_available(), reason="the attention kernel is not built here")
@pytest.mark.parametrize("changes, match", ATTENTION_REFUSALS, ids=[m[:40] for _, m in ATTENTION_REFUSALS])
def test_the_attention_kernel_refuses_bad_arguments_with_an_error(changes, match):
    torch.ops.specdec_cpu.invariant_attention(**_attention_args())  # the unchanged call is valid
    with pytest.raises(RuntimeError, match=match):
        torch.ops.specdec_cpu.invariant_attention(**_attention_args(**changes))


@pytest.mark.skipif(not cpu.linear_kernel_available(), reason="the bfloat16 linear kernel needs AVX2 and FMA")
@pytest.mark.parametrize("call, match", [
    (lambda w: torch.ops.specdec_cpu.linear_bf16(torch.randn(3, 24), w, None), "x of shape \\[3, 24\\] against"),
    (lambda w: torch.ops.specdec_cpu.linear_bf16(torch.randn(3, 32), w.float(), None), "contiguous 2-D bfloat16"),
    (lambda w: torch.ops.specdec_cpu.linear_bf16(torch.randn(3, 32), w, torch.randn(5)), "the bias has 5 values"),
    (lambda w: torch.ops.specdec_cpu.linear_bf16(torch.randn(3, 32), w[:, :12].contiguous(), None),
     "positive multiple of 8"),
    (lambda w: torch.ops.specdec_cpu.linear_bf16(torch.ones(3, 32, dtype=torch.long), w, None),
     "floating-point"),
])
def test_the_bfloat16_linear_kernel_refuses_bad_arguments_with_an_error(call, match):
    with pytest.raises(RuntimeError, match=match):
        call(torch.randn(10, 32).bfloat16())
