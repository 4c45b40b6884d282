"""What suffix decoding's tries cost: memory per cached token and the time of a step's
update and lookup, at the sizes a server's cache reaches.

    python scripts/bench_suffix_cache.py --requests 1000 --tokens 200

Sequences are drawn from a small vocabulary with repeated spans (as agent traffic
repeats itself), added to the shared cache one finished request at a time; then requests
of a few hundred tokens draft and accept tokens as the engine would (an update of the
request's own trie, then a lookup in both tries per step).
"""

from __future__ import annotations

import argparse
import random
import time
import tracemalloc
from types import SimpleNamespace

from specdec_suffix import SuffixConfig, SuffixDrafter

from specdec import SamplingParams


def sequence(rng: random.Random, length: int, spans: list[list[int]]) -> list[int]:
    out: list[int] = []
    while len(out) < length:
        out += rng.choice(spans) if rng.random() < 0.6 else [rng.randrange(32000) for _ in range(rng.randint(1, 8))]
    return out[:length]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    rng = random.Random(0)
    spans = [[rng.randrange(32000) for _ in range(rng.randint(4, 24))] for _ in range(200)]
    drafter = SuffixDrafter(SuffixConfig(decoding_type="suffix", max_cached_requests=args.requests), target=None)
    tracemalloc.start()
    started = time.perf_counter()
    for _ in range(args.requests):
        tokens = sequence(rng, args.tokens, spans)
        drafter.on_request_finished(SimpleNamespace(drafter_state={}, token_ids=tokens, prompt_len=0,
                                                    sampling_params=SamplingParams()))
    added = time.perf_counter() - started
    memory, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    cached = drafter.cache.tokens
    request = SimpleNamespace(drafter_state={}, token_ids=sequence(rng, 300, spans), prompt_len=300,
                              sampling_params=SamplingParams())
    update = lookup = 0.0
    drafted = 0
    for _ in range(args.steps):
        started = time.perf_counter()
        drafter.on_draft_verified([SimpleNamespace(request=request, new_token_ids=[1])])
        update += time.perf_counter() - started
        started = time.perf_counter()
        (proposal,) = drafter.prepare_draft_tokens([request], [16], [32])
        lookup += time.perf_counter() - started
        drafted += len(proposal.token_ids) if proposal else 0
        accepted = proposal.token_ids[:rng.randint(0, 3)] if proposal else []
        request.token_ids += accepted + [rng.choice(rng.choice(spans))]
    print(f"cache: {args.requests} requests, {cached} tokens, {drafter.cache.trie.nodes} nodes, "
          f"{memory / 2**20:.1f} MiB ({memory / cached:.0f} bytes a cached token), added in {added:.2f} s "
          f"({1e6 * added / cached:.1f} us a token)")
    print(f"a step: update {1e6 * update / args.steps:.0f} us, lookup in both tries "
          f"{1e6 * lookup / args.steps:.0f} us, {drafted / args.steps:.1f} nodes drafted")


if __name__ == "__main__":
    main()
