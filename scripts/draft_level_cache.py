"""What one draft level of a hidden-state drafter costs with its weights in the CPU's cache
and after a target step has pushed them out, part by part.

    .venv/bin/python scripts/draft_level_cache.py [eagle3|mtp|eagle] [--calls 200]

A target step streams the whole model (about 100 MB for the default target) through caches
a fraction of that size, so the drafter's weights are cold when its first level runs. The
script captures one one-token draft forward and one head call from a short chat on the
default target, then times them back to back (warm) and each after streaming 128 MB through
the cache (cold), and prints the milliseconds of each part, and of streaming the 128 MB.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM, SamplingParams
from specdec.model.target import compiled_step

EVICT_BYTES = 128 * 2**20


def capture(llm: LLM) -> tuple[tuple, object, torch.Tensor]:
    """Arguments of the first one-token compiled draft forward, its step metadata, and the
    first one-row input of the head, from a short chat."""
    drafter, got = llm.drafter, {}
    forward, head = drafter.runner._compiled, drafter.head_logits

    def forward_spy(*args):
        if len(args[0]) == 1 and "args" not in got:
            got["args"], got["meta"] = args, compiled_step.meta
        return forward(*args)

    def head_spy(hidden):
        if hidden.shape[0] == 1 and "head" not in got:
            got["head"] = hidden.clone()
        return head(hidden)

    drafter.runner._compiled, drafter.head_logits = forward_spy, head_spy
    try:
        llm.chat([[{"role": "user", "content": "Write a short poem about the sea."}]],
                 SamplingParams(max_tokens=32, temperature=0.0))
    finally:
        drafter.runner._compiled, drafter.head_logits = forward, head
    return got["args"], got["meta"], got["head"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", nargs="?", default="eagle3")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(speculative_config={"decoding_type": args.method, "adaptive": False})
    if llm.drafter.runner._compiled is None:
        raise SystemExit(f"{args.method}: the draft module runs eagerly here; this script times the compiled one")
    forward_args, meta, hidden = capture(llm)
    forward, head = llm.drafter.runner._compiled, llm.drafter.head_logits
    evict = torch.ones(EVICT_BYTES // 4)
    parts = {"draft forward": lambda: forward(*forward_args), "head": lambda: head(hidden),
             "forward and head": lambda: head(forward(*forward_args)[:1])}
    compiled_step.meta = meta
    try:
        with torch.inference_mode():
            print(f"{args.method}, {args.calls} calls each, ms a call")
            print("| part | warm | cold |")
            print("|---|---|---|")
            for name, call in parts.items():
                for _ in range(20):
                    call()
                started = time.perf_counter()
                for _ in range(args.calls):
                    call()
                warm = (time.perf_counter() - started) / args.calls
                cold = 0.0
                for _ in range(args.calls):
                    evict.add_(1.0)
                    started = time.perf_counter()
                    call()
                    cold += time.perf_counter() - started
                print(f"| {name} | {warm * 1e3:.3f} | {cold / args.calls * 1e3:.3f} |")
            started = time.perf_counter()
            for _ in range(20):
                evict.add_(1.0)
            print(f"streaming {EVICT_BYTES >> 20} MB: {(time.perf_counter() - started) / 20 * 1e3:.2f} ms")
    finally:
        compiled_step.meta = None


if __name__ == "__main__":
    main()
