"""The torch attention's padded groups merged (:func:`padded_groups`) against one group per
width class (1, 2-3, 4-7, ... new tokens: what it did before), on the same engine, step by step.

    .venv/bin/python scripts/bench_padded_groups.py [--context 200] [--batch-invariant] [--rounds 12]
        [SHAPE ...]

A shape is one width per sequence (``2,1,1,1,1,1,1,1``: eight decoding sequences, one of them
verifying a draft token), as in ``scripts/profile_step.py --curve``. Every round runs each
shape once with either grouping, in alternating order; prints the median forward per shape
and grouping (bfloat16, the embedded model, ``--threads``).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import specdec.kernels.layout as layout
from profile_step import step_runner
from specdec import LLM

SHAPES = ["1,1,1,1,1,1,1,1", "2,1,1,1,1,1,1,1", "3,2,1,1,1,1,1,1", "4,1,1,1,1,1,1,1", "3,3,3,1,1,1,1,1",
          "2,4,8,1,1,1,1,1", "13,1,1,1,1,1,1,1"]


def width_classes(sequences: list[tuple[int, int]]) -> list[list[int]]:
    """One group per :func:`width_group`, none merged."""
    groups: dict[int, list[int]] = {}
    for i, (_, n) in enumerate(sequences):
        groups.setdefault(layout.width_group(n), []).append(i)
    return [groups[k] for k in sorted(groups)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shapes", nargs="*", default=SHAPES)
    p.add_argument("--context", type=int, default=200)
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(dtype="bfloat16", engine={"batch_invariant": args.batch_invariant})
    policies = {"width classes": width_classes, "merged": layout.padded_groups}
    runs = {s: step_runner(llm, args.context, [int(w) for w in s.split(",")], batch_invariant=args.batch_invariant)
            for s in args.shapes}
    times = {(s, name): [] for s in args.shapes for name in policies}
    for r in range(args.rounds + 1):  # round 0 warms up
        for s, run in runs.items():
            for name in (list(policies) if r % 2 else list(policies)[::-1]):
                layout.padded_groups = policies[name]  # the layout reads it when a step builds its view
                started = time.perf_counter()
                run()
                times[(s, name)].append(time.perf_counter() - started)
    layout.padded_groups = policies["merged"]
    print(f"# context {args.context}, batch_invariant {args.batch_invariant}, {args.rounds} rounds: median ms")
    print(f"{'shape':>18} {'width classes':>14} {'merged':>8} {'ratio':>6}")
    for s in args.shapes:
        old, new = (1000 * statistics.median(times[(s, name)][1:]) for name in policies)
        print(f"{s:>18} {old:>14.1f} {new:>8.1f} {new / old:>6.2f}")


if __name__ == "__main__":
    main()
