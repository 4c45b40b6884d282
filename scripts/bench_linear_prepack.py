"""One bfloat16 linear layer through stock ``F.linear`` against the same weight prepacked for
oneDNN (:mod:`specdec.kernels.prepacked`), for the embedded model's shapes: microseconds per
call (mean of ``--calls``, after a warm-up) for 1 and 16 rows, and whether the results are
bit-identical (BENCHMARKS.md, "Prepacked bfloat16 weights"). ``--dtype float32`` shows why
float32 is left stock.

    .venv/bin/python scripts/bench_linear_prepack.py [--threads 2] [--dtype float32]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from specdec.kernels.prepacked import pack_weight, packed_linear

#: (out, in): attention q/o, k/v, MLP gate/up, MLP down, LM head of SmolLM2-135M
SHAPES = ((576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576))


def per_call_us(product, x: torch.Tensor, weight: torch.Tensor, calls: int) -> float:
    for _ in range(5):
        product(x, weight)
    started = time.perf_counter()
    for _ in range(calls):
        product(x, weight)
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print(f"{'shape (out x in)':<18}{'rows':>5}{'F.linear us':>13}{'prepacked us':>14}{'ratio':>7}  identical")
    for out_features, in_features in SHAPES:
        weight = torch.randn(out_features, in_features, generator=g).to(dtype)
        packed = pack_weight(weight)
        calls = max(args.calls // 20, 10) if out_features > 10000 else args.calls
        for rows in (1, 16):
            x = torch.randn(rows, in_features, generator=g).to(dtype)
            stock = per_call_us(F.linear, x, weight, calls)
            fast = per_call_us(packed_linear, x, packed, calls)
            same = torch.equal(F.linear(x, weight), packed_linear(x, packed))
            shape = f"{out_features} x {in_features}"
            print(f"{shape:<18}{rows:>5}{stock:>13.0f}{fast:>14.0f}{stock / fast:>6.2f}x  {same}")


if __name__ == "__main__":
    main()
