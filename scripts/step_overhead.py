"""Where a step's time goes outside the target forward: plain decoding and methods, side by side.

    .venv/bin/python scripts/step_overhead.py ngram eagle3 mtp [--dataset benchmarks/diverse.jsonl |
        --categories chat math_reasoning] [--batch-size 8] [--max-tokens 96] [--threads 2] [--repetitions 1]

Runs the prompt set in batches (greedy, bfloat16) on plain decoding and on each method's
engine, the systems one after another per repetition, and times the engine's parts by
wrapping them: the step, the target forward, settling (verification, appending, the
drafter's ``on_draft_verified``), the decode items (the planner's ``plan`` and ``trim``, the
drafter's ``prepare_draft_tokens``) and the planner's learning from the step. Prints each
part in milliseconds per step and ``outside forward``: the step's time less the forward's.
These parts are Python and small tensor work, so they vary less with a shared machine's
load than the forward does; the forward's figure is printed for scale only.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch

from ab_planner import add_prompt_options, conversations_of
from specdec import LLM, SamplingParams
from specdec.bench import WARMUP

ENGINE_PARTS = ["step", "_forward", "_settle", "_decode_items", "_greedy_verdicts", "_hand_over_hidden"]
PLANNER_PARTS = ["plan", "trim", "observe_step", "observe_asks"]
HOOKS = ["prepare_draft_tokens", "on_draft_verified"]


def timed(obj, name: str, seconds: collections.Counter, calls: collections.Counter) -> None:
    """Replace ``obj.name`` by a wrapper adding its wall time to ``seconds[name]`` and
    counting its calls."""
    inner = getattr(obj, name)

    def wrapper(*args, **kwargs):
        calls[name] += 1
        started = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - started

    setattr(obj, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("methods", nargs="+", help="decoding types")
    add_prompt_options(p)
    p.add_argument("--repetitions", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    conversations = conversations_of(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    systems = ["plain", *args.methods]
    seconds = {name: collections.Counter() for name in systems}
    calls = {name: collections.Counter() for name in systems}
    for _ in range(args.repetitions):
        for name in systems:
            llm = LLM(dtype="bfloat16", speculative_config=None if name == "plain" else {"decoding_type": name})
            llm.chat([WARMUP], SamplingParams(max_tokens=4, temperature=0.0))
            engine = llm.engine
            for part in ENGINE_PARTS:
                timed(engine, part, seconds[name], calls[name])
            if engine.planner is not None:
                for part in PLANNER_PARTS:
                    timed(engine.planner, part, seconds[name], calls[name])
            if engine.hooks is not None:
                for part in HOOKS:
                    timed(engine.hooks, part, seconds[name], calls[name])
            for start in range(0, len(conversations), args.batch_size):
                llm.chat(conversations[start:start + args.batch_size], params)
    print(f"# {len(conversations)} requests at batch {args.batch_size}, {args.max_tokens} tokens, "
          f"{args.repetitions} repetitions, {args.threads} threads, bfloat16; milliseconds per step")
    parts = [p for p in ENGINE_PARTS + PLANNER_PARTS + HOOKS if any(seconds[n][p] for n in systems)]
    print(f"{'system':10s} {'steps':>6s} " + " ".join(f"{p.strip('_'):>14.14s}" for p in parts) + "  outside forward")
    for name in systems:
        n = max(calls[name]["_forward"], 1)  # a step that runs nothing does not call the forward
        s = seconds[name]
        print(f"{name:10s} {n:6d} " + " ".join(f"{s[p] / n * 1e3:14.3f}" for p in parts)
              + f"  {(s['step'] - s['_forward']) / n * 1e3:15.3f}")


if __name__ == "__main__":
    main()
