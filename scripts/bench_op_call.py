"""What calling a Python operator costs through each of torch's registration APIs: the
reason ``torch.ops.specdec.paged_attention`` (the compiled target's attention, called once
per layer per step) is defined with ``torch.library.Library`` and not
``torch.library.custom_op`` (BENCHMARKS.md, "Compiled target forward"). Each variant wraps
the same function with the attention operator's signature; microseconds a call, the best of
``--rounds`` rounds of ``--calls`` calls.

    .venv/bin/python scripts/bench_op_call.py [--calls 20000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch

SCHEMA = ("(Tensor query, Tensor key, Tensor value, int layer, float scale, int? sliding_window, float? softcap)"
          " -> Tensor")


def body(query, key, value, layer, scale, sliding_window, softcap):
    return query.clone()


@torch.library.custom_op("bench_op_call::through_custom_op", mutates_args=())
def _through_custom_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scale: float,
                       sliding_window: int | None, softcap: float | None) -> torch.Tensor:
    return body(query, key, value, layer, scale, sliding_window, softcap)


_library = torch.library.Library("bench_op_call", "FRAGMENT")
_library.define("through_library" + SCHEMA)
_library.impl("through_library", body, "CompositeExplicitAutograd")


def best_us(call, calls: int, rounds: int) -> float:
    for _ in range(100):
        call()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    q = torch.randn(1, 9, 1, 64)
    variants = {"the function itself": lambda: body(q, q, q, 0, 0.125, None, None),
                "torch.library.Library": lambda: torch.ops.bench_op_call.through_library(q, q, q, 0, 0.125, None, None),
                "torch.library.custom_op": lambda: torch.ops.bench_op_call.through_custom_op(q, q, q, 0, 0.125, None,
                                                                                             None)}
    for name, call in variants.items():
        print(f"{name:<26}{best_us(call, args.calls, args.rounds):8.2f} us a call")


if __name__ == "__main__":
    main()
