"""bfloat16 linear layers on weights prepacked for oneDNN (engine.prepack_weights)."""

import functools

import pytest
import torch
import torch.nn.functional as F

from specdec import LLM, SamplingParams
from specdec.kernels import prepack_linear, prepacked
from specdec.kernels.prepacked import can_prepack, packed_linear
from specdec.numerics.invariant import make_linear_invariant, restore_linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
#: whether oneDNN's reordered bfloat16 product is bit-identical to ``F.linear`` on this CPU (on
#: an AVX-512 EPYC it is; on an AVX2 one it is not, and every weight stays stock)
PACKS = can_prepack(torch.zeros(576, 576, dtype=torch.bfloat16))
needs_exact_packing = pytest.mark.skipif(not PACKS, reason="the reordered product is not exact on this CPU")


@pytest.fixture(autouse=True)
def without_the_linear_kernel(monkeypatch):
    """This file checks oneDNN's packing; where oneDNN refuses it (no bfloat16 instructions)
    layers get specdec's linear kernel instead, which ``tests/kernels/test_cpu_linear.py`` checks."""
    from specdec.numerics import invariant

    monkeypatch.setattr(prepacked, "linear_kernel_fits", lambda weight: False)
    monkeypatch.setattr(invariant, "linear_kernel_fits", lambda weight: False)


@needs_exact_packing
@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (1536, 576), (576, 49152), (64, 128)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_linear_is_bit_identical_to_the_stock_one(shape, bias):
    torch.manual_seed(0)
    layer = torch.nn.Linear(*shape, bias=bias).to(torch.bfloat16)
    x = torch.randn(40, shape[0]).to(torch.bfloat16)
    with torch.inference_mode():
        stock = [layer(x[:rows]) for rows in (1, 3, 8, 17, 40)] + [layer(x[None, :6])]
        assert prepack_linear(layer)
        assert layer.forward.func is packed_linear and layer.forward.keywords["packed"].is_mkldnn
        packed = [layer(x[:rows]) for rows in (1, 3, 8, 17, 40)] + [layer(x[None, :6])]
    for a, b in zip(stock, packed):
        assert torch.equal(a, b)
    restore_linear(layer)
    assert "forward" not in layer.__dict__


def test_only_bfloat16_cpu_weights_whose_packed_product_is_exact_are_prepacked(monkeypatch):
    layer = torch.nn.Linear(64, 32)
    assert not can_prepack(layer.weight) and not prepack_linear(layer)  # float32: stock product kept
    assert "forward" not in layer.__dict__
    layer.to(torch.bfloat16)
    monkeypatch.setattr(prepacked, "packing_is_exact", lambda *shape: False)  # as on a CPU where it differs
    assert not can_prepack(layer.weight) and not prepack_linear(layer)
    assert "forward" not in layer.__dict__
    monkeypatch.setattr(prepacked, "packing_is_exact", lambda *shape: True)
    assert can_prepack(layer.weight)


def test_an_invariant_one_part_plan_multiplies_by_the_prepacked_weight():
    """The batch-invariant mode's row-padding plans run on the packed weight too, with the
    same result as on the plain one."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(1536, 576).to(torch.bfloat16)  # the embedded model's down projection
    x = torch.randn(20, 1536).to(torch.bfloat16)
    with torch.inference_mode():
        if not make_linear_invariant(layer):
            pytest.skip("the stock product is already row-invariant on this machine")
        plan = layer.forward.keywords["plan"]
        out = layer(x)
        if plan.parts == 1:  # packed where packing is exact on this CPU
            assert layer.forward.keywords["weight"].is_mkldnn == can_prepack(layer.weight)
        reference = functools.partial(layer.forward.func, weight=layer.weight if plan.parts == 1
                                      else layer.forward.keywords["weight"], bias=layer.bias, plan=plan)
        assert torch.equal(out, reference(x))
        assert torch.equal(layer(x[:1]), out[:1])


def test_the_engine_prepacks_a_bfloat16_target_and_answers_as_without(tiny_models):
    prompts = [[5, 9, 13, 2, 7], [11, 3, 3, 8]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs, linears = {}, {}
    for prepack in (True, False):
        llm = LLM(str(tiny_models["llama"]), dtype="bfloat16", engine={"prepack_weights": prepack})
        outputs[prepack] = [o.token_ids for o in llm.generate(prompts, params)]
        linears[prepack] = [m for m in llm.target.model.modules() if isinstance(m, torch.nn.Linear)]
    # each shape packed where its reordered product is exact on this CPU, stock elsewhere
    assert linears[True] and all((m.forward.func is packed_linear) if can_prepack(m.weight)
                                 else ("forward" not in m.__dict__) for m in linears[True])
    assert all("forward" not in m.__dict__ for m in linears[False])
    assert outputs[True] == outputs[False]
    x = torch.randn(3, linears[True][0].in_features).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(linears[True][0](x), F.linear(x, linears[True][0].weight, linears[True][0].bias))


def test_a_drafters_modules_are_prepacked_and_draft_exactly_as_without():
    """EAGLE-3's shipped head on the embedded model: with its linear layers prepacked it
    proposes the same drafts (same accepted counts) and the answer is the same."""
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    runs = {}
    for prepack in (True, False):
        llm = LLM(dtype="bfloat16", speculative_config={"decoding_type": "eagle3", "adaptive": False},
                  engine={"prepack_weights": prepack})
        linears = [m for module in llm.drafter.draft_modules() for m in module.modules()
                   if isinstance(m, torch.nn.Linear)]
        assert linears and all(("forward" in m.__dict__) == (prepack and can_prepack(m.weight)) for m in linears)
        out = llm.generate(["Write a short poem about the sea."], params)[0]
        runs[prepack] = (out.token_ids, out.metrics.num_accepted_tokens, out.metrics.num_draft_tokens)
    assert runs[True] == runs[False]
    assert runs[True][1] > 0
