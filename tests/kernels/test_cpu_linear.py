"""specdec's bfloat16 linear kernel for CPUs without bfloat16 instructions
(``specdec.kernels.cpu.kernel_linear``): right, batch-invariant, and what the engine runs
there. Where this CPU has bfloat16 instructions the engine tests force the kernel, so the
path is checked on every x86 machine with AVX2."""

import pytest
import torch
import torch.nn.functional as F

from specdec import LLM
from specdec.kernels import cpu, prepack_linear
from specdec.numerics.invariant import restore_linear
from specdec.testing import check_greedy_lossless

pytestmark = pytest.mark.skipif(not cpu.linear_kernel_available(),
                                reason="the bfloat16 linear kernel needs an x86 CPU with AVX2, FMA and a C++ compiler")

#: out x in: tails of the 3-output tile (7, 50), the embedded model's shapes, its LM head's input
SHAPES = [(7, 64), (50, 24), (192, 576), (576, 1536)]
ROWS = (1, 2, 3, 4, 5, 7, 8, 13, 33)


def weights(out_features: int, in_features: int):
    g = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = (torch.randn(out_features, in_features, generator=g) * in_features ** -0.5).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    x = torch.randn(max(ROWS), in_features, generator=g).to(torch.bfloat16)
    return x, weight, bias


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_the_kernel_is_the_product_rounded_once_to_bfloat16(shape):
    """Against the float32 product of the same bfloat16 numbers: within one rounding to
    bfloat16 (relative 2**-8) plus float32 summation error; with and without a bias."""
    x, weight, bias = weights(*shape)
    for b in (None, bias):
        want = F.linear(x.float(), weight.float(), None if b is None else b.float())
        for rows in ROWS:
            got = cpu.kernel_linear(x[:rows], weight, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, shape[0])
            torch.testing.assert_close(got.float(), want[:rows], rtol=2 ** -8, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_row_gets_the_same_bits_with_any_rows_beside_it_and_any_thread_count(shape):
    x, weight, bias = weights(*shape)
    alone = torch.cat([cpu.kernel_linear(x[i:i + 1], weight, bias) for i in range(len(x))])
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            for rows in ROWS:
                assert torch.equal(cpu.kernel_linear(x[:rows], weight, bias), alone[:rows]), f"{rows} rows, {count}"
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(cpu.kernel_linear(x[None, :5], weight, bias)[0], alone[:5])  # [batch, tokens, features]


def test_shapes_the_kernel_does_not_take_stay_with_torch():
    assert not cpu.linear_kernel_fits(torch.zeros(8, 12, dtype=torch.bfloat16))  # input not whole vectors
    assert not cpu.linear_kernel_fits(torch.zeros(8, 16))  # float32: MKL's products are fast already
    with pytest.raises(RuntimeError, match="multiple of 8"):
        torch.ops.specdec_cpu.linear_bf16(torch.zeros(1, 12, dtype=torch.bfloat16),
                                          torch.zeros(8, 12, dtype=torch.bfloat16), None)


def test_a_gradient_goes_through_torch():
    """Training reuses the target's layers; the kernel has no backward, so a product that
    needs one is torch's."""
    x, weight, bias = weights(7, 64)
    x = x[:3].clone().requires_grad_(True)
    cpu.kernel_linear(x, weight, bias).float().sum().backward()
    torch.testing.assert_close(x.grad.float(), weight.float().sum(0).expand(3, -1), rtol=1e-2, atol=1e-2)


@pytest.fixture
def without_bfloat16_instructions(monkeypatch):
    """This CPU as one without bfloat16 instructions: prepacking is refused, the kernel serves."""
    from specdec.kernels import prepacked

    monkeypatch.setattr(cpu, "native_bfloat16", lambda: False)
    monkeypatch.setattr(prepacked, "can_prepack", lambda weight: False)


def test_layers_get_the_kernel_where_the_cpu_has_no_bfloat16_instructions(without_bfloat16_instructions):
    layer = torch.nn.Linear(64, 7).to(torch.bfloat16)
    assert prepack_linear(layer) and layer.forward.func is cpu.kernel_linear
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert torch.equal(layer(x), cpu.kernel_linear(x, layer.weight, layer.bias))
    restore_linear(layer)
    assert "forward" not in layer.__dict__


def test_the_embedded_model_on_the_kernel_is_lossless(without_bfloat16_instructions):
    """Greedy ngram output equals plain greedy output, drafts accepted, with every bfloat16
    linear layer on the kernel, in the batch-invariant mode (which takes the kernel as its
    linear: bit-exact whatever the step's token count; the stock attention is not)."""
    engine = {"batch_invariant": True}
    prompts = [[{"role": "user", "content": "Repeat this line twice: the red fox jumps over the old stone wall."}],
               [{"role": "user", "content": "Name 4 fruits."}]]
    llm = LLM(dtype="bfloat16", engine=engine)
    linears = [m for m in llm.engine.target.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(m.forward.func is cpu.kernel_linear for m in linears)
    ids = [llm.apply_chat_template(p) for p in prompts]
    check_greedy_lossless({"decoding_type": "ngram", "max_draft_len": 4}, prompts=ids, max_tokens=32,
                          dtype="bfloat16", engine=engine, min_accepted=4)


def test_the_embedded_model_computes_the_same_logits_through_the_kernel(without_bfloat16_instructions):
    """The kernel changes how products are summed, not what they compute: through it the
    embedded model's bfloat16 logits over a chat prompt are as close to the float32 model's
    as through torch's products (a single product of either is the exact one rounded once;
    the model's 30 layers spread bfloat16 rounding to ~0.2 a logit), and its greedy choices
    are the float32 model's wherever the top two are not a near-tie there."""
    from specdec.kernels import prepack_linears
    from specdec.model.loading import load_causal_lm, load_tokenizer, resolve_model_dir

    path = resolve_model_dir(None)
    tokenizer = load_tokenizer(path)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Give three tips for sleeping better."}],
                                         add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    model = load_causal_lm(path, torch.bfloat16, torch.device("cpu"))
    with torch.no_grad():
        exact = load_causal_lm(path, torch.float32, torch.device("cpu"))(ids).logits[0]
        stock = model(ids).logits[0].float()
        assert prepack_linears(model) > 0
        kernel = model(ids).logits[0].float()
    stock_error, kernel_error = (stock - exact).abs().mean(), (kernel - exact).abs().mean()
    assert kernel_error < 1.5 * stock_error + 0.02, (kernel_error, stock_error)
    top2 = exact.topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 1.0
    assert clear.sum() > len(ids[0]) // 2
    assert torch.equal(kernel.argmax(-1)[clear], exact.argmax(-1)[clear])
