"""bfloat16 products of the embedded model's linear shapes: torch's ``F.linear`` against
specdec's CPU linear kernel (``specdec.kernels.cpu.kernel_linear``), interleaved, medians.

    python scripts/bench_cpu_linear.py [--threads 2] [--rounds 15] [--rows 1 2 4 8 16 64]

The kernel is what bfloat16 layers run on CPUs without bfloat16 instructions
(BENCHMARKS.md, "bfloat16 on CPUs without bfloat16 instructions"); it runs on any x86 CPU
with AVX2 and FMA, so this compares the two on machines with bfloat16 instructions too.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from specdec.kernels import cpu

#: out x in: q/o projections, k/v, MLP up and gate, MLP down, LM head (SmolLM2-135M)
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576)]


def timed(fn, x: torch.Tensor, weight: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(x, weight)
    return (time.perf_counter() - start) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if not cpu.linear_kernel_available():
        raise SystemExit("the linear kernel is not built here (it needs AVX2, FMA and a C++ compiler)")
    print(f"# {args.threads} threads, bfloat16, medians of {args.rounds} interleaved rounds; "
          f"oneDNN bfloat16 on this CPU: {cpu.native_bfloat16()}")
    print("out x in   rows   F.linear ms   kernel ms   ratio")
    for out_features, in_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * in_features ** -0.5).to(torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, in_features).to(torch.bfloat16)
            reps = max(1, int(2e7 // (out_features * in_features * max(rows, 4))))
            stock, kernel = [], []
            for _ in range(args.rounds):
                stock.append(timed(F.linear, x, weight, reps))
                kernel.append(timed(cpu.kernel_linear, x, weight, reps))
            a, b = statistics.median(stock) * 1e3, statistics.median(kernel) * 1e3
            print(f"{out_features}x{in_features:<6} {rows:4d}   {a:11.3f}   {b:9.3f}   {a / b:5.2f}x", flush=True)


if __name__ == "__main__":
    main()
