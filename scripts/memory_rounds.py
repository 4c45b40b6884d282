"""One engine's resident memory over rounds of the same mixed work: a leak grows it every
round, a warm-up only in the first.

Each round sends 16 requests in batches of 8 on the default target: prompts of 4,000,
2,500, 1,500 and 800 tokens and twelve of 1 to 400, greedy and seeded sampling, 32 tokens
each. Every round's prompts start with a token of its own, so none is found in the prefix
cache and each round writes new KV blocks (the pool hands out the least recently freed).

    .venv/bin/python scripts/memory_rounds.py eagle3 --rounds 10
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

from specdec import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import long_document_prompt  # noqa: E402


def rss_mb() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("method", help="a decoding type, or plain")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM(speculative_config=None if args.method == "plain" else {"decoding_type": args.method})
    rng = random.Random(0)
    lengths = [4000, 2500, 1500, 800] + [rng.randint(1, 400) for _ in range(12)]
    prompts = [long_document_prompt(llm.get_tokenizer(), n) for n in lengths]
    params = [SamplingParams(max_tokens=32, temperature=0.0 if i % 2 else 0.8, seed=i) for i in range(len(prompts))]
    pool = llm.engine.kv.pool
    print(f"{args.method}: {rss_mb()} MB after loading", flush=True)
    for r in range(args.rounds):
        started = time.perf_counter()
        fresh = [[1000 + r] + ids for ids in prompts]
        for i in range(0, len(fresh), 8):
            llm.generate(fresh[i:i + 8], params[i:i + 8])
        print(f"round {r}: {rss_mb()} MB ({time.perf_counter() - started:.0f} s), blocks holding cached prompts "
              f"{len(pool.hash_of)} of {pool.num_blocks}", flush=True)


if __name__ == "__main__":
    main()
