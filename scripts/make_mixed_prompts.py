"""A training pool mixed from prompt files: the first N prompts of each (or prompts START to
END, to train on prompts an earlier pool left out), shuffled together, then the held-out
prompts last (the trainer measures acceptance on a pool's last 16).

    python scripts/make_mixed_prompts.py --take train_prompts/prompts.jsonl:1600 \\
        --take train_prompts/self_instruct.jsonl:1600 --held-out train_prompts/prompts.jsonl \\
        --seed 0 --out .train/w4a8/mixed.jsonl
"""

import argparse
import json
import random
from pathlib import Path


def prompts(path: str) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def taken(spec: str) -> list[str]:
    """FILE:N, the first N prompts of FILE, or FILE:START-END, its prompts START to END - 1."""
    path, _, span = spec.rpartition(":")
    start, _, end = span.rpartition("-")
    return prompts(path)[int(start or 0):int(end)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--take", action="append", required=True, metavar="FILE:N",
                        help="the first N prompts of FILE, or FILE:START-END for prompts START to END - 1")
    parser.add_argument("--held-out", metavar="FILE", help="append FILE's last 16 prompts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    pool = [p for spec in args.take for p in taken(spec)]
    random.Random(args.seed).shuffle(pool)
    pool += prompts(args.held_out)[-16:] if args.held_out else []
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in pool))
    print(f"{args.out}: {len(pool)} prompts")


if __name__ == "__main__":
    main()
