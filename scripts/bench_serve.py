"""`specdec serve` against in-process ``LLM()`` and native ``llama-server``, side by side.

Starts `specdec serve` (its engine in a process of its own) and an ``LLM`` in this process
from one config and, with ``--llama-server``, native llama-server on the same GGUF with
the same threads (plain, and with its ``ngram-mod`` speculation; ``--parallel`` slots equal
to the batch; built once by :mod:`specdec.bench.llama_cpp_native` if not on PATH). Each round
runs, in turn, every system over the script's chat prompts at each batch size: batch 1 is
prompt by prompt, batch N is N requests at once (N concurrent clients of a server, or one
``LLM.chat`` of N conversations). Servers are timed at the client through the ``openai``
client's chat endpoint. Only one system works at a time. Prints aggregate tok/s per system
and batch (median over rounds, spread), the ratio to ``LLM()``, and each server's request
latency (p50, p99 over all its requests at that batch).

    .venv/bin/python scripts/bench_serve.py --rounds 3 --batches 1,8 --llama-server
"""

from __future__ import annotations

import argparse
import contextlib
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


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def openai_system(base: str, max_tokens: int, stream: bool):
    """A server's chat endpoint as a system: run(convs) -> (tokens, seconds, latencies)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=900)

    def ask(conv):
        started = time.perf_counter()
        if not stream:
            r = client.chat.completions.create(model="any", messages=conv, max_tokens=max_tokens, temperature=0)
            return r.usage.completion_tokens, time.perf_counter() - started
        tokens = 0
        for chunk in client.chat.completions.create(model="any", messages=conv, max_tokens=max_tokens,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens, time.perf_counter() - started

    def run(convs):
        started = time.perf_counter()
        with ThreadPoolExecutor(len(convs)) as pool:
            answers = list(pool.map(ask, convs))
        return sum(t for t, _ in answers), time.perf_counter() - started, [s for _, s in answers]
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="", help="YAML text both specdec sides use (default: the defaults)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--llama-server", action="store_true", help="native llama-server beside them")
    parser.add_argument("--llama-cpp-bin", help="where llama-server is (default: PATH, the cache, or built)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]

    import torch
    import yaml
    from specdec_test_support.served import running_server

    from specdec import LLM, SamplingParams
    from specdec.bench.llama_cpp_native import LlamaServer, find_binaries
    from specdec.config_loading import config_from_dict
    from specdec.model.loading import gguf_file

    config = config_from_dict(yaml.safe_load(args.config))
    llm = LLM(config=config)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]

    def library(convs):
        started = time.perf_counter()
        outs = llm.chat(convs, params)
        return sum(len(o.token_ids) for o in outs), time.perf_counter() - started, []

    rows: dict[tuple[str, int], list[float]] = {}
    latencies: dict[tuple[str, int], list[float]] = {}
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        base = stack.enter_context(running_server(args.config, tmp))
        specdec_systems = {"LLM()": library, "specdec serve": openai_system(base, args.max_tokens, False),
                           "specdec serve stream": openai_system(base, args.max_tokens, True)}
        bin_dir = find_binaries(args.llama_cpp_bin) if args.llama_server else None
        for batch in batches:
            systems = dict(specdec_systems)
            servers = []
            if bin_dir is not None:
                gguf = gguf_file(config.model)
                for name, extra in (("llama-server", ()), ("llama-server ngram-mod", ("--spec-type", "ngram-mod"))):
                    server = LlamaServer(bin_dir, gguf, torch.get_num_threads(), 4096, batch, extra)
                    servers.append(server)
                    systems[name] = openai_system(server.base, args.max_tokens, False)
            convs = (chats * (batch // len(chats) + 1))[:batch]
            for run in systems.values():  # warm-up: compile, caches, slots
                run(convs)
            for r in range(args.rounds):
                for name, run in systems.items():
                    tokens = seconds = 0.0
                    groups = [[c] for c in chats] if batch == 1 else [convs]
                    for group in groups:
                        t, s, lat = run(group)
                        tokens, seconds = tokens + t, seconds + s
                        latencies.setdefault((name, batch), []).extend(lat)
                    rows.setdefault((name, batch), []).append(tokens / seconds)
                print(f"batch {batch} round {r + 1}: " + ", ".join(
                    f"{n} {v[-1]:.1f}" for (n, b), v in rows.items() if b == batch), flush=True)
            for server in servers:
                server.close()
    print(f"\nmachine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
          f"config: {args.config or 'defaults'!r}, {args.max_tokens} tokens max")
    print(f"{'system':<24}{'batch':>6}{'tok/s':>9}{'spread':>15}{'x LLM()':>9}{'p50 s':>8}{'p99 s':>8}")
    for (name, b), values in rows.items():
        median = statistics.median(values)
        lat = latencies.get((name, b))
        p50 = f"{percentile(lat, 0.5):.2f}" if lat else "-"
        p99 = f"{percentile(lat, 0.99):.2f}" if lat else "-"
        print(f"{name:<24}{b:>6}{median:>9.1f}{f'{min(values):.1f}-{max(values):.1f}':>15}"
              f"{median / statistics.median(rows[('LLM()', b)]):>9.2f}{p50:>8}{p99:>8}")


if __name__ == "__main__":
    main()
