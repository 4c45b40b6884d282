"""A sampled row's distribution and draw: torch's operations against specdec's CPU sampling
kernel (``specdec.kernels.cpu.sampling_probs``, ``inverse_cdf``), interleaved, medians, on
the default target's own logits for a few self-written prompts.

    python scripts/bench_sampling_kernel.py [--threads 2] [--rounds 15] [--rows 1 4 8]

A step at temperature computes one such row per verified node (the root at least) and
per drafted token, and draws once or more (BENCHMARKS.md, "Sampling on the CPU kernel").
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.executor.verifier import Verifier
from specdec.kernels import cpu
from specdec.sampler.logits import probs_from_logits_torch

PROMPTS = ["Describe a walk along a river at dawn.", "How does a bicycle stay upright?",
           "Write a short note thanking a neighbour for watering the plants."]
SETTINGS = {"t0.7 top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9), "t1.0": SamplingParams(temperature=1.0),
            "t0.8 top_k 40": SamplingParams(temperature=0.8, top_k=40)}


def target_rows(count: int) -> torch.Tensor:
    """``[count, vocab]`` logits the default target computed while answering :data:`PROMPTS`."""
    rows: list[torch.Tensor] = []
    verify = Verifier.verify

    def keep(self, items, logits):
        rows.append(logits.detach().clone())
        return verify(self, items, logits)

    Verifier.verify = keep
    try:
        llm = LLM()
        for prompt in PROMPTS:
            llm.chat([{"role": "user", "content": prompt}], SamplingParams(max_tokens=count, temperature=0.7))
    finally:
        Verifier.verify = verify
    return torch.cat(rows)[-count:]


def interleaved_ms(fns: list, items: list, rounds: int) -> list[float]:
    """Each of ``fns`` over all ``items`` in turn, ``rounds`` times: the median ms per item of each."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, its_times in zip(fns, times):
            start = time.perf_counter()
            for item in items:
                fn(item)
            its_times.append((time.perf_counter() - start) / len(items))
    return [1e3 * statistics.median(t) for t in times]


def row(name: str, n: int, ms: list[float]) -> None:
    print(f"{name:18} {n:>4} {ms[0]:>9.3f} {ms[1]:>9.3f} {ms[0] / ms[1]:>7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    args = parser.parse_args()
    if not cpu.kernel_available():
        raise SystemExit("specdec's CPU kernels are not built here")
    logits = target_rows(64)
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads, vocabulary {logits.shape[1]}, ms a call of `rows` rows: medians of {args.rounds} "
          "rounds over 64 rows")
    print(f"{'settings':18} {'rows':>4} {'torch ms':>9} {'kernel ms':>9} {'speedup':>8}")
    for name, params in SETTINGS.items():
        for n in args.rows:
            groups = [logits[i:i + n] for i in range(0, len(logits) - n + 1, n)]
            row(name, n, interleaved_ms([lambda x, p=params: probs_from_logits_torch(x, p),
                                         lambda x, p=params: cpu.sampling_probs(x, p.temperature, p.top_k, p.top_p,
                                                                                p.min_p)], groups, args.rounds))
    probs = probs_from_logits_torch(logits, SETTINGS["t0.7 top_p 0.9"])
    uniforms = torch.rand(len(probs), dtype=torch.float64).tolist()

    def torch_draw(i: int) -> None:
        cdf = probs[i:i + 1].double().cumsum(-1)
        torch.searchsorted(cdf, uniforms[i] * cdf[:, -1:], right=True)

    row("draw (inverse CDF)", 1, interleaved_ms([torch_draw, lambda i: cpu.inverse_cdf(probs[i:i + 1], [uniforms[i]])],
                                                 list(range(len(probs))), args.rounds))


if __name__ == "__main__":
    main()
