"""Acceptance of drafters on the held-out prompts of the training set (the last 16 of
train_prompts/prompts.jsonl, which no shipped drafter saw): acceptance length, per-position
acceptance, and whether each system's text equals the first one's. BENCHMARKS.md quotes it.

    python scripts/eval_heldout.py --dtype bfloat16 \\
        '{"decoding_type": "redrafter", "adaptive": false}' '{"decoding_type": "medusa", "adaptive": false}'
"""

import argparse
import json

from specdec import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("configs", nargs="+", help="speculative_config objects as JSON")
    parser.add_argument("--data", default="train_prompts/prompts.jsonl")
    parser.add_argument("--prompts", type=int, default=8, help="the first N of the 16 held-out prompts")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    with open(args.data) as f:
        held_out = [json.loads(line) for line in f][-16:][:args.prompts]
    prompts = [[{"role": "user", "content": item["prompt"]}] for item in held_out]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    first = None
    for text in args.configs:
        outs = LLM(dtype=args.dtype, speculative_config=json.loads(text)).chat(prompts, params)
        first = first or outs
        length = sum(len(o.token_ids) for o in outs) / sum(o.metrics.num_steps for o in outs)
        depth = max(len(o.metrics.per_position_acceptance) for o in outs)
        per_position = [sum(o.metrics.per_position_acceptance[k] for o in outs
                            if len(o.metrics.per_position_acceptance) > k) / len(outs) for k in range(depth)]
        same = sum(a.token_ids == b.token_ids for a, b in zip(first, outs))
        print(f"{text}: acceptance length {length:.3f}, per position {[round(p, 2) for p in per_position]}, "
              f"same text as the first {same}/{len(outs)}", flush=True)


if __name__ == "__main__":
    main()
