"""Quantized products of the embedded model's linear shapes: specdec's integer-dot kernels
(``w4a8``, ``w8a8``: 8-bit activations) against torch's packed kernels (``int4``, ``int8``)
on the same weights, interleaved, medians, by row count.

    python scripts/bench_int8_dot.py [--threads 2] [--rounds 15] [--rows 1 4 16]

Each shape's weights are random (their values do not change the work); a small shape's
weights stay in cache between calls, so its times are the kernel's arithmetic, not the
streaming of a model's weights from memory (``scripts/profile_step.py`` measures that).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdec.kernels import int8_dot
from specdec.model.quantization import Int4Linear, Int8Linear, W4A8Linear, W8A8Linear

#: out x in: q/o projections, k/v, MLP up and gate, MLP down, LM head (SmolLM2-135M)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def timed(layer, x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        layer(x)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    int8_dot.require_kernel()
    print(f"# {args.threads} threads, bfloat16 activations, microseconds per call (median of {args.rounds} rounds)")
    print(f"{'out x in':>12} {'rows':>4} {'w4a8':>8} {'int4':>8} {'ratio':>6} {'w8a8':>8} {'int8':>8} {'ratio':>6}")
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        weight = torch.randn(n, k, generator=g) * 0.02
        layers = {"w4a8": W4A8Linear.from_weight(weight, None, torch.bfloat16),
                  "int4": Int4Linear.from_weight(weight, None, torch.bfloat16),
                  "w8a8": W8A8Linear.from_weight(weight, None, torch.bfloat16),
                  "int8": Int8Linear.from_weight(weight, None, torch.bfloat16)}
        reps = max(2, 2_000_000 // (n * k))
        for rows in args.rows:
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            times = {name: [] for name in layers}
            for name, layer in layers.items():
                timed(layer, x, reps)  # warm
            for _ in range(args.rounds):
                for name, layer in layers.items():
                    times[name].append(timed(layer, x, reps) * 1e6)
            us = {name: statistics.median(t) for name, t in times.items()}
            print(f"{f'{n}x{k}':>12} {rows:>4} {us['w4a8']:8.1f} {us['int4']:8.1f} {us['w4a8'] / us['int4']:5.2f}x "
                  f"{us['w8a8']:8.1f} {us['int8']:8.1f} {us['w8a8'] / us['int8']:5.2f}x")


if __name__ == "__main__":
    main()
