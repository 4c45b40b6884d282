"""What the adaptive planner costs and what its choices bring, for one method: four
engines side by side on one prompt set, batch by batch in a rotating order.

    .venv/bin/python scripts/planner_overhead.py eagle3 [--depth 1] [--option use_dynamic_tree=false]
        [--dataset benchmarks/diverse.jsonl | --categories ...] [--batch-size 1] [--max-tokens 128]
        [--repetitions 2] [--temperature 0.7 --top-p 0.9]

- ``plain``: no drafts;
- ``fixed``: the method drafting ``--depth`` levels every step (``adaptive: false``);
- ``forced on``: the adaptive planner observing every step (acceptance, cost fits) but
  asked for nothing: it drafts what ``fixed`` drafts, so its time over ``fixed``'s is the
  planner's bookkeeping;
- ``adaptive``: the planner deciding (``max_draft_len: --depth``).

Prints each engine's tokens/s, its ratio to plain, tokens per step of a request and
milliseconds per engine step (prefill steps included).
"""

from __future__ import annotations

import argparse
import time

import torch
import yaml
from ab_planner import add_prompt_options, conversations_of, sampling_of

from specdec import LLM, SamplingParams
from specdec.bench.runner import WARMUP


def engines(method: str, depth: int, options: dict) -> dict[str, LLM]:
    spec = {"decoding_type": method, "max_draft_len": depth, **options}
    forced = LLM(speculative_config=spec)
    forced.engine.planner.plan = lambda reqs, caps, shape: caps
    forced.engine.planner.trim = lambda reqs, proposals, shape: proposals
    return {"plain": LLM(), "fixed": LLM(speculative_config={**spec, "adaptive": False}), "forced on": forced,
            "adaptive": LLM(speculative_config=spec)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("method", help="a decoding type")
    p.add_argument("--depth", type=int, default=1, help="max_draft_len of the speculative engines")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE",
                   help="another speculative_config option of the three speculative engines (a YAML value)")
    add_prompt_options(p)
    p.set_defaults(dataset="benchmarks/diverse.jsonl", batch_size=1, max_tokens=128)
    p.add_argument("--repetitions", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    conversations = conversations_of(args)
    options = {name: yaml.safe_load(value) for name, _, value in (o.partition("=") for o in args.option)}
    llms = engines(args.method, args.depth, options)
    for llm in llms.values():
        llm.chat([WARMUP], SamplingParams(max_tokens=4, temperature=0.0))
    params = sampling_of(args)
    names = list(llms)
    # steps: engine steps, a batch's being its longest request's (its requests start together)
    tokens, seconds, steps = dict.fromkeys(names, 0), dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    request_steps = dict.fromkeys(names, 0)
    for rep in range(args.repetitions):
        for turn, start in enumerate(range(0, len(conversations), args.batch_size)):
            shift = (turn + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                started = time.perf_counter()
                outs = llms[name].chat(conversations[start:start + args.batch_size], params)
                seconds[name] += time.perf_counter() - started
                tokens[name] += sum(len(o.token_ids) for o in outs)
                steps[name] += max(o.metrics.num_steps for o in outs)
                request_steps[name] += sum(o.metrics.num_steps for o in outs)
    plain = tokens["plain"] / seconds["plain"]
    print(f"# {args.method}, depth {args.depth}: {len(conversations)} requests at batch {args.batch_size}, "
          f"{args.max_tokens} tokens, {args.repetitions} repetitions, {args.threads} threads, the default target")
    for name in names:
        rate = tokens[name] / seconds[name]
        print(f"{name:10s} {rate:7.1f} tok/s  {rate / plain:.3f}x  "
              f"tokens/step {tokens[name] / request_steps[name]:.3f}  ms/step {1e3 * seconds[name] / steps[name]:.2f}")


if __name__ == "__main__":
    main()
