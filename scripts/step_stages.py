"""Where an engine step's time goes, stage by stage: each method's engine runs a prompt set
as `specdec bench` does (multi-turn conversations turn by turn, ``--batch-size`` requests
together, the bench's warm-up first), with every stage of its step timed.

    .venv/bin/python scripts/step_stages.py plain ngram suffix benchmarks/mtp_fixed.yaml
        [--dataset benchmarks/agentic.jsonl] [--categories agent] [--batch-size 1] [--max-tokens 128]
        [--temperature 0.7 --top-p 0.9]

Prints, per method, tokens/s and engine steps, then the milliseconds a step of each stage:
the target's forward, the verifier, the planner (before drafting, trimming, observing), the
drafter's hooks (drafting, learning from verified tokens), the scheduler, output and KV
commit. The stages outside the forward are what speculation costs besides the verified
rows. The methods' engines live in one process and take each batch in turn, so that the
machine's drift between minutes falls on all of them alike.
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from ab_planner import add_prompt_options, sampling_of

from specdec import LLM, SamplingParams
from specdec.bench.runner import WARMUP, CategoryResult, _prompt_sets, method_config, run_llm
from specdec.config import SpecdecConfig

#: (owner attribute of the engine or None for the engine itself, method, label)
STAGES = [(None, "forward", "forward"), ("verifier", "verify", "verify"), ("scheduler", "schedule", "schedule"),
          ("outputs", "process", "outputs"), ("kv_commit", "commit", "commit"),
          ("planner", "plan", "planner: plan"), ("planner", "trim", "planner: trim"),
          ("planner", "observe_step", "planner: observe"),
          ("drafts", "propose", "drafter: draft"), ("drafts", "propose_lookup", "lookup: draft"),
          ("hooks", "on_draft_verified", "drafter: verified")]


def timed(engine, seconds: collections.Counter) -> None:
    """Wrap each stage of ``engine`` (those it has) to add its wall time into ``seconds``."""
    for owner, name, label in [*STAGES, (None, "step", "step")]:
        obj = engine if owner is None else getattr(engine, owner, None)
        inner = getattr(obj, name, None)
        if inner is None:
            continue

        def stage(*args, _inner=inner, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - started
                seconds[_label + " calls"] += 1
        setattr(obj, name, stage)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("methods", nargs="+", help="plain, a decoding type or a YAML file (as `specdec bench` takes)")
    add_prompt_options(parser)
    parser.set_defaults(batch_size=1, max_tokens=128)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sets = _prompt_sets(args.dataset, args.categories, args.batch_size)
    params = sampling_of(args)
    engines = []  # (method, its llm, its stages' seconds, its result)
    for system in args.methods:
        method, config = method_config(SpecdecConfig(), system)
        llm = LLM(config=config)
        llm.generate([llm.apply_chat_template(WARMUP)], SamplingParams(max_tokens=4, temperature=0.0))
        seconds: collections.Counter = collections.Counter()
        timed(llm.engine, seconds)
        engines.append((method, llm, seconds, CategoryResult()))
    for conversations in sets.values():  # the engines in turn, batch by batch: the machine's drift shared
        for i in range(0, len(conversations), args.batch_size):
            for _, llm, _, res in engines:
                run_llm(llm, conversations[i:i + args.batch_size], params, args.batch_size, res)
    for method, _, seconds, res in engines:
        steps = seconds["step calls"]
        print(f"{method}: {res.tokens / res.seconds:.1f} tok/s, {steps} steps, {1000 * seconds['step'] / steps:.3f} ms "
              "a step")
        for label in [label for *_, label in STAGES if seconds[label + " calls"]]:
            print(f"  {label:20s} {1000 * seconds[label] / steps:7.3f} ms a step")
        outside = seconds["step"] - sum(seconds[label] for _, _, label in STAGES)
        print(f"  {'the rest':20s} {1000 * outside / steps:7.3f} ms a step (the draft stage's items, metrics)")


if __name__ == "__main__":
    main()
