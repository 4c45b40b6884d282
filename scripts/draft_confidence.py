"""How well a chain drafter's own probabilities predict what the target accepts (the
methods that draft through the core's chains: eagle, eagle3, mtp).

    .venv/bin/python scripts/draft_confidence.py eagle3 [--depth 3] [--dataset benchmarks/diverse.jsonl]
        [--prompts 16] [--max-tokens 128]

Runs the method's fixed chains of ``--depth`` levels, never stopped
(``min_chain_probability: 0``), greedy, one prompt at a time, and records each drafted
token's probability under the drafter (the argmax's). Greedy output is plain decoding's,
so a level is accepted where its token and every one before it equal the output's. Prints,
per level, the share of drafts accepted (of those whose parent was) by the level's draft
probability, the count in brackets: what ``min_chain_probability`` relies on.
"""

from __future__ import annotations

import argparse

import torch

import specdec.drafting.tree_expansion as expansions
from specdec import LLM, SamplingParams
from specdec.bench.prompt_sets import load_jsonl

BUCKETS = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0001]


def recorded_chains() -> list[dict]:
    """Every chain drafted from now on: its request's tokens when drafted, its tokens, their probabilities."""
    chains, grow = [], expansions.ChainExpansion.grow

    def recording(self, nodes, logits):
        if not self.tokens:
            chains.append({"at": len(self.request.token_ids), "tokens": [], "probs": []})
        new = grow(self, nodes, logits)
        chains[-1]["tokens"].append(self.tokens[-1])
        chains[-1]["probs"].append(float(torch.softmax(logits[0].float(), -1).max()))
        return new

    expansions.ChainExpansion.grow = recording
    return chains


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method")
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--dataset", default="benchmarks/diverse.jsonl")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    args = p.parse_args()
    torch.set_num_threads(2)
    prompts = [c for convs in load_jsonl(args.dataset).values() for c in convs][:args.prompts]
    llm = LLM(speculative_config={"decoding_type": args.method, "adaptive": False, "max_draft_len": args.depth,
                                  "min_chain_probability": 0.0, "use_dynamic_tree": False})
    chains = recorded_chains()
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    drafts = []  # (probabilities, whether each level's token is the output's)
    for prompt in prompts:
        del chains[:]
        out = llm.chat([prompt], params)[0]
        full = out.prompt_token_ids + out.token_ids
        for c in chains:
            drafts.append((c["probs"], [c["at"] + j < len(full) and full[c["at"] + j] == t
                                        for j, t in enumerate(c["tokens"])]))
    print(f"{args.method}: {len(drafts)} chains of {args.depth}; accepted share by draft probability")
    print("| level | " + " | ".join(f"{lo:.1f}-{min(hi, 1.0):.1f}" for lo, hi in zip(BUCKETS, BUCKETS[1:])) + " |")
    print("|---" * len(BUCKETS) + "|")
    for level in range(args.depth):
        cells = []
        for lo, hi in zip(BUCKETS, BUCKETS[1:]):
            hits = [ok[level] for probs, ok in drafts
                    if len(probs) > level and all(ok[:level]) and lo <= probs[level] < hi]
            cells.append(f"{sum(hits) / len(hits):.2f} ({len(hits)})" if hits else "-")
        print(f"| {level + 1} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
