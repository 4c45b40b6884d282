"""The CPU sampling kernel (``sampling.cpp``) against the torch versions it stands in for:
:func:`specdec.sampler.logits.probs_from_logits_torch` and the float64 inverse CDF."""

import pytest
import torch

from specdec import SamplingParams
from specdec.kernels import cpu
from specdec.sampler import acceptance, probs_from_logits
from specdec.sampler import logits as sampler_logits
from specdec.sampler.logits import probs_from_logits_torch

pytestmark = pytest.mark.skipif(not cpu.kernel_available(), reason="specdec's CPU kernels are not built here")

SETTINGS = [
    dict(temperature=0.7, top_p=0.9),
    dict(temperature=1.0),
    dict(temperature=0.6, top_k=20),
    dict(temperature=1.3, top_p=0.95, min_p=0.05),
    dict(temperature=0.5, top_p=0.5, top_k=50),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=2.0, top_p=0.999),  # a flat row: the nucleus is thousands of tokens
    dict(temperature=1.0, top_p=1e-9),  # rounds to nothing: the likeliest token alone
]


def _kernel(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    return cpu.sampling_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)


def _logits(rows: int, vocab: int) -> torch.Tensor:
    """Rows like a language model's: a few likely tokens over a long tail, plus a flat row,
    a row with a tie across the nucleus's edge and a row with tokens masked to -inf."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    logits[:, :8] += torch.linspace(12, 4, 8)
    logits[1] = torch.randn(vocab, generator=gen) * 0.01
    logits[2, :4] = torch.tensor([5.0, 5.0, 5.0, 5.0])
    logits[3, vocab // 2:] = float("-inf")
    return logits


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()))
@pytest.mark.parametrize("vocab", [49152, 4095, 37])
def test_the_kernel_keeps_the_torch_versions_tokens_and_probabilities(settings, vocab):
    params = SamplingParams(**settings)
    logits = _logits(6, vocab)
    got, want = _kernel(logits, params), probs_from_logits_torch(logits, params)
    edge = (got > 0) != (want > 0)
    if edge.any():  # kept by one only: a float32 sum of ~49k terms landing on top_p itself
        assert "top_p" in settings, "the kept tokens differ"
        full = probs_from_logits_torch(logits.double(), SamplingParams(**{**settings, "top_p": 1.0}))
        for row, token in edge.nonzero().tolist():
            before = full[row][full[row] > full[row, token]].sum().item()
            assert abs(before - settings["top_p"]) < 1e-5, f"row {row}: token {token} differs off the nucleus edge"
    torch.testing.assert_close(got.masked_fill(edge, 0), want.masked_fill(edge, 0), atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(got.sum(-1), torch.ones(6), atol=1e-6, rtol=0)


def test_ties_at_the_nucleus_edge_are_kept_together():
    logits = torch.full((1, 1000), -20.0)
    logits[0, :5] = torch.tensor([3.0, 2.0, 2.0, 2.0, 1.0])
    probs = _kernel(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert probs[0, :4].gt(0).all() and probs[0, 4:].eq(0).all()


def test_a_row_depends_on_nothing_but_itself():
    logits = _logits(6, 4095)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40)
    together = _kernel(logits, params)
    for row in range(6):
        assert torch.equal(_kernel(logits[row:row + 1], params)[0], together[row])


def test_the_inverse_cdf_draws_the_torch_versions_token():
    probs = probs_from_logits_torch(_logits(6, 49152), SamplingParams(temperature=0.7, top_p=0.9))
    uniforms = [0.0, 0.25, 0.5, 0.999999, 1 - 2 ** -53, 0.7]
    cdf = probs.double().cumsum(-1)
    at = torch.tensor(uniforms, dtype=torch.float64)[:, None] * cdf[:, -1:]
    want = torch.searchsorted(cdf, at, right=True).clamp_(max=probs.shape[-1] - 1)[:, 0]
    got = cpu.inverse_cdf(probs, uniforms)
    assert torch.equal(got, want)
    assert torch.equal(acceptance.sample_by_uniforms(probs, uniforms), want)
    assert probs[torch.arange(6), got].gt(0).all(), "a zero-probability token was drawn"


def test_sampled_requests_on_the_cpu_get_the_kernel(monkeypatch):
    calls = []

    def spy(*args):
        calls.append(args)
        return cpu.sampling_probs(*args)

    monkeypatch.setattr(sampler_logits, "sampling_probs_cpu", spy)
    probs_from_logits(_logits(6, 4095), SamplingParams(temperature=0.7, top_p=0.9))
    probs_from_logits(_logits(6, 4095), SamplingParams(temperature=0.0))  # greedy: the argmax's one-hot
    assert len(calls) == 1
