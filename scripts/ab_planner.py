"""The adaptive planner's settings side by side: plain decoding and a method's engines, each
with planner attributes of its own, over a prompt set in batches.

    .venv/bin/python scripts/ab_planner.py ngram --variant request_prior_weight=3 \\
        --variant request_prior_weight=1 [--dataset benchmarks/diverse.jsonl |
        --categories code_editing qa_over_text] [--batch-size 8] [--repetitions 3]
        [--max-tokens 96] [--threads 2] [--temperature 0.7 --top-p 0.9]

What ``specdec bench`` does for methods, for settings that are not configuration: the
batches are interleaved one by one in an order that rotates, multi-turn conversations go
turn by turn with each engine's own answers (the bench's runner), and every repetition
builds fresh engines (ngram's pool must not find the previous repetition's answers). A
variant sets attributes of the engine's :class:`~specdec.executor.planner.DraftPlanner`, or
of its parts by a dotted name (``request_prior_weight=1``, ``probes.share=0.01``; several
separated by commas). Prints each system's tokens/s, its ratio to plain, and how many of
its answers equal plain's.
"""

from __future__ import annotations

import argparse
import gc

import torch

from specdec import LLM, SamplingParams
from specdec.bench.prompt_sets import PROMPTS, load_jsonl, messages
from specdec.bench.runner import WARMUP, CategoryResult, concurrent_requests, run_llm


def parse_settings(text: str) -> dict[str, float]:
    """``name=value[,name=value]`` -> planner attributes (dotted: of its parts)."""
    settings = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        settings[name.strip()] = float(value)
    return settings


def set_planner_attributes(llm: LLM, settings: dict[str, float]) -> None:
    for name, value in settings.items():
        *parts, attribute = name.split(".")
        owner = llm.engine.planner
        for part in parts:
            owner = getattr(owner, part, None)
        if owner is None or not hasattr(owner, attribute):
            raise SystemExit(f"the planner has no attribute {name!r}")
        setattr(owner, attribute, value)


def add_prompt_options(p: argparse.ArgumentParser) -> None:
    """The prompt set's options (the script adds what it runs: a method, or several)."""
    p.add_argument("--dataset", help="a JSONL prompt set (default: the built-in categories)")
    p.add_argument("--categories", nargs="+", help="built-in categories (default: all)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)


def sampling_of(args: argparse.Namespace) -> SamplingParams:
    """The requests' sampling (``add_prompt_options``), seeded: a request's output is then
    the same whatever was drafted, as under greedy decoding."""
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=0)


def conversations_of(args: argparse.Namespace) -> list:
    """The requests of ``add_prompt_options``' prompt set, in order (a built-in category's
    made distinct up to the batch size, as ``specdec bench`` makes them)."""
    if args.dataset:
        return [c for convs in load_jsonl(args.dataset).values() for c in convs]
    return [c for name in args.categories or PROMPTS for c in concurrent_requests(messages(name), args.batch_size)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("method", help="a decoding type")
    add_prompt_options(p)
    p.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE[,NAME=VALUE]",
                   help="planner attributes of one engine of the method (repeatable; none: the defaults)")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--per-batch", action="store_true",
                   help="also each batch's speed-up (a built-in category is one batch at batch size 8)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    conversations = conversations_of(args)
    variants = [parse_settings(v) for v in args.variant] or [{}]
    labels = ["plain"] + [f"{i} {args.method} {','.join(f'{k}={v:g}' for k, v in v.items()) or 'defaults'}"
                          for i, v in enumerate(variants, start=1)]
    params = sampling_of(args)
    results = {label: CategoryResult() for label in labels}
    batch_seconds: dict[tuple[str, int], float] = {}
    answers: dict[str, list[list[int]]] = {}
    for rep in range(args.repetitions):
        llms = {"plain": LLM()}
        for label, settings in zip(labels[1:], variants):
            llms[label] = LLM(speculative_config={"decoding_type": args.method})
            set_planner_attributes(llms[label], settings)
        for llm in llms.values():
            llm.chat([WARMUP], SamplingParams(max_tokens=4, temperature=0.0))
        for turn, start in enumerate(range(0, len(conversations), args.batch_size)):
            shift = (turn + rep) % len(labels)
            for label in labels[shift:] + labels[:shift]:
                res = results[label]
                before, answered = res.seconds, len(res.outputs or [])
                run_llm(llms[label], conversations[start:start + args.batch_size], params, args.batch_size, res)
                batch_seconds[label, turn] = batch_seconds.get((label, turn), 0.0) + res.seconds - before
                if rep == 0:
                    answers.setdefault(label, []).extend(res.outputs[answered:])
        del llms
        gc.collect()
    plain = results["plain"].tokens / results["plain"].seconds
    print(f"# {len(conversations)} conversations ({len(answers['plain'])} answers) at batch {args.batch_size}, "
          f"{args.max_tokens} tokens, {args.repetitions} repetitions, {args.threads} threads, the default target")
    for label in labels:
        rate = results[label].tokens / results[label].seconds
        same = sum(a == b for a, b in zip(answers[label], answers["plain"]))
        print(f"{label:40s} {rate:7.1f} tok/s  {rate / plain:.3f}x  same {same}/{len(answers['plain'])}")
    if args.per_batch:
        turns = range(0, -(-len(conversations) // args.batch_size))
        print("per batch, plain's time over each system's: " + " ".join(f"b{t}" for t in turns))
        for label in labels[1:]:
            print(f"{label:40s} " + " ".join(f"{batch_seconds['plain', t] / batch_seconds[label, t]:.2f}"
                                            for t in turns))


if __name__ == "__main__":
    main()
