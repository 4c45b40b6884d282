"""`specdec serve` against in-process ``LLM()`` on the same configuration, timed side by side.

Starts the server (its engine in a process of its own) and an ``LLM`` in this process from
one config, then for each round, in turn: the library's ``generate``, the server
non-streamed and streamed over its OpenAI chat endpoint (the ``openai`` client, timed at the
client), at batch 1 (prompt by prompt) and at batch N (N prompts at once; N concurrent
clients). Only one side works at a time: the other idles. Prints tok/s per system and round
and each server row's ratio to the library's (medians over rounds).

    .venv/bin/python scripts/bench_serve.py --rounds 3 --batch 8
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

PROMPTS = [
    "Summarize in two sentences: the engine keeps a paged KV cache, reuses prefixes across requests, "
    "and rolls back rejected draft tokens so that speculation never changes the output.",
    "Rewrite this Python function with a list comprehension:\n\ndef squares(xs):\n    out = []\n"
    "    for x in xs:\n        out.append(x * x)\n    return out",
    "Where is the Eiffel Tower, and when was it built?",
    "Write a short friendly reply to a colleague who asked whether the meeting moved to Thursday.",
    "Explain what a hash map is to a new programmer.",
    "List five uses of a paper clip.",
    "Translate into French: the weather is nice today and we will walk to the market.",
    "Give three tips for writing clear commit messages.",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="YAML text both sides use (default: the defaults)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()

    import yaml
    from openai import OpenAI

    from specdec import LLM, SamplingParams
    from specdec.config_loading import config_from_dict
    from specdec.testing import running_server

    llm = LLM(config=config_from_dict(yaml.safe_load(args.config)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    batch = (chats * (args.batch // len(chats) + 1))[:args.batch]

    def library(convs):
        started = time.perf_counter()
        outs = llm.chat(convs, params)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - started

    with tempfile.TemporaryDirectory() as tmp, running_server(args.config, tmp) as base:
        client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=600)

        def ask(conv, stream):
            if not stream:
                r = client.chat.completions.create(model="any", messages=conv, max_tokens=args.max_tokens,
                                                   temperature=0)
                return r.usage.completion_tokens
            tokens = 0
            for chunk in client.chat.completions.create(model="any", messages=conv, max_tokens=args.max_tokens,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}):
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            return tokens

        def server(convs, stream):
            started = time.perf_counter()
            with ThreadPoolExecutor(len(convs)) as pool:
                tokens = sum(pool.map(lambda c: ask(c, stream), convs))
            return tokens, time.perf_counter() - started

        systems = {"library": lambda convs: library(convs), "serve": lambda convs: server(convs, False),
                   "serve stream": lambda convs: server(convs, True)}
        for run in systems.values():  # warm-up: compile, caches
            run(chats[:1])
            run(batch)
        rows: dict[tuple[str, int], list[float]] = {}
        for r in range(args.rounds):
            for name, run in systems.items():
                tokens = seconds = 0.0
                for conv in chats:  # batch 1: one request at a time
                    t, s = run([conv])
                    tokens, seconds = tokens + t, seconds + s
                rows.setdefault((name, 1), []).append(tokens / seconds)
                t, s = run(batch)
                rows.setdefault((name, args.batch), []).append(t / s)
            print(f"round {r + 1}: " + ", ".join(f"{n} b{b} {v[-1]:.1f}" for (n, b), v in rows.items()), flush=True)
    print(f"\nmachine: {platform.processor() or platform.machine()}, config: {args.config or 'defaults'!r}")
    print(f"{'system':<14}{'batch':>6}{'tok/s (median)':>16}{'spread':>16}{'x library':>11}")
    for (name, b), values in rows.items():
        base_median = statistics.median(rows[("library", b)])
        median = statistics.median(values)
        print(f"{name:<14}{b:>6}{median:>16.1f}{f'{min(values):.1f}-{max(values):.1f}':>16}"
              f"{median / base_median:>11.2f}")


if __name__ == "__main__":
    main()
