"""What the batch-invariant mode (:mod:`specdec.kernels.invariant`) costs per operation, against
the stock path, for the embedded model's shapes in bfloat16 on the CPU (BENCHMARKS.md,
"Bit-exact bfloat16"): microseconds per layer, each call going through 30 layers' own
weights or caches as a forward does (one layer's would stay in the CPU's cache), the
median of ``--rounds`` rounds in which every variant runs in turn.

- the MLP down projection (1536 -> 576, the one linear shape whose stock product is not
  row-invariant here): the stock prepacked product, the mode's plan (two half products on
  prepacked slices, added in float32) and the same plan through one ``bmm`` on unpacked
  slices (what the mode used before);
- one layer's attention (9 query heads, 3 KV heads, head size 64) for a decode step, a
  verification step and a prompt chunk, at batch 1 and 8: the stock torch path against
  the invariant one, the step's layout built once as the engine does;
- building a step's layout (``AttentionLayout.invariant_rows`` and the stock ``padded``).

    .venv/bin/python scripts/bench_invariant_ops.py [--threads 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from specdec.kernels import AttentionLayout, SequenceSlice
from specdec.kernels.attention import paged_attention_torch
from specdec.kernels.invariant import LinearPlan, invariant_attention_torch, plan_weight, planned_linear
from specdec.kernels.prepacked import pack_weight, packed_linear

BLOCK = 16
LAYERS = 30
#: (sequences, cached tokens, new tokens) per attention case
CASES = {"decode, batch 1": (1, 256, 1), "decode, batch 8": (8, 256, 1), "verify 16, batch 1": (1, 256, 16),
         "verify 4, batch 8": (8, 256, 4), "prompt 300, batch 1": (1, 0, 300), "prompt 60, batch 8": (8, 0, 60)}


def median_us(variants: dict, rounds: int, calls: int, per: int = 1) -> dict[str, float]:
    """Median microseconds of ``calls`` calls of each variant, divided by ``per``."""
    times: dict[str, list[float]] = {name: [] for name in variants}
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - started) / calls / per * 1e6)
    return {name: statistics.median(t) for name, t in times.items()}


def layout(seqs: int, cached: int, new: int) -> AttentionLayout:
    blocks = -(-(cached + new) // BLOCK)
    return AttentionLayout([SequenceSlice(block_table=list(range(i * blocks, (i + 1) * blocks)), start=cached,
                                          positions=torch.arange(cached, cached + new)) for i in range(seqs)],
                           BLOCK, torch.device("cpu"))


def each(product, x, weights, *args) -> None:
    """``product`` of ``x`` by every layer's weight."""
    for weight in weights:
        product(x, weight, *args)


def each_layer(attention, query, pools, step_layout) -> None:
    """``attention`` of ``query`` over every layer's cache."""
    for keys, values in pools:
        attention(query, keys, values, step_layout, 0.125)


def built(view: str, seqs: int, cached: int, new: int):
    """A fresh step layout's ``view``."""
    return getattr(layout(seqs, cached, new), view)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)

    weights = [(torch.randn(576, 1536, generator=g) * 1536 ** -0.5).to(torch.bfloat16) for _ in range(LAYERS)]
    plan = LinearPlan(1, 2)
    packed = [pack_weight(w) for w in weights]
    slices = [plan_weight(w, plan) for w in weights]
    unpacked = [w.view(576, 2, 768).permute(1, 2, 0).contiguous() for w in weights]
    print("MLP down projection 1536 -> 576, us per layer")
    print(f"{'rows':>5}{'stock':>8}{'mode':>8}{'bmm':>8}  mode == bmm")
    for rows in (1, 16, 128, 512):
        x = torch.randn(rows, 1536, generator=g).to(torch.bfloat16)
        us = median_us({"stock": partial(each, packed_linear, x, packed),
                        "mode": partial(each, planned_linear, x, slices, None, plan),
                        "bmm": partial(each, planned_linear, x, unpacked, None, plan)}, args.rounds, 1, LAYERS)
        same = all(torch.equal(planned_linear(x, a, None, plan), planned_linear(x, b, None, plan))
                   for a, b in zip(slices, unpacked))
        print(f"{rows:>5}{us['stock']:>8.0f}{us['mode']:>8.0f}{us['bmm']:>8.0f}  {same}")

    print("\nattention, us per layer (the step's layout built once, as the engine does)")
    print(f"{'case':<22}{'stock':>8}{'mode':>8}{'ratio':>7}")
    for case, (seqs, cached, new) in CASES.items():
        blocks = seqs * -(-(cached + new) // BLOCK)
        pools = [(torch.randn(blocks * BLOCK, 3, 64, generator=g).to(torch.bfloat16),
                  torch.randn(blocks * BLOCK, 3, 64, generator=g).to(torch.bfloat16)) for _ in range(LAYERS)]
        query = torch.randn(9, seqs * new, 64, generator=g).to(torch.bfloat16)
        stock_layout, mode_layout = layout(seqs, cached, new), layout(seqs, cached, new)
        us = median_us({"stock": partial(each_layer, paged_attention_torch, query, pools, stock_layout),
                        "mode": partial(each_layer, invariant_attention_torch, query, pools, mode_layout)},
                       args.rounds, 1, LAYERS)
        print(f"{case:<22}{us['stock']:>8.0f}{us['mode']:>8.0f}{us['mode'] / us['stock']:>6.2f}x")

    print("\nbuilding a step's layout, us")
    print(f"{'case':<22}{'padded':>8}{'invariant_rows':>16}")
    for case, (seqs, cached, new) in CASES.items():
        us = median_us({"padded": partial(built, "padded", seqs, cached, new),
                        "invariant": partial(built, "invariant_rows", seqs, cached, new)}, args.rounds, 5)
        print(f"{case:<22}{us['padded']:>8.0f}{us['invariant']:>16.0f}")


if __name__ == "__main__":
    main()
