"""Systems each alone in a process of its own, as a deployment runs one engine, in rounds.

    .venv/bin/python scripts/one_engine_per_process.py plain eagle3 benchmarks/eagle3_fixed.yaml \\
        [--dataset benchmarks/diverse.jsonl] [--max-tokens 128] [--rounds 2]

``specdec bench`` runs its systems side by side in one process, which keeps the machine's
state the same for all of them but gives each engine neighbours that a served engine does
not have (their weights in the caches, their compiled graphs). Here every round starts one
process per system in turn (names as ``specdec bench`` takes them: ``plain``, a method, a
YAML file); each warms up, then answers the prompts one at a time (batch 1, greedy) and
reports its tokens per second and acceptance length. A round's ratios are against that
round's plain decoding, which must come first.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def run_alone(system: str, dataset: str, max_tokens: int) -> dict:
    """In this process: ``system`` on the default target over ``dataset``'s prompts."""
    import torch

    from specdec import LLM, SamplingParams
    from specdec.bench.prompt_sets import load_jsonl
    from specdec.bench.runner import method_config
    from specdec.config import SpecdecConfig

    torch.set_num_threads(2)
    _, config = method_config(SpecdecConfig(), system)
    llm = LLM(speculative_config=config.speculative_config, engine=config.engine)
    prompts = [c for convs in load_jsonl(dataset).values() for c in convs]
    llm.chat(prompts[:2], SamplingParams(max_tokens=32, temperature=0.0))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    tokens = steps = off = 0
    started = time.perf_counter()
    for prompt in prompts:
        out = llm.chat([prompt], params)[0]
        tokens += len(out.token_ids)
        steps += out.metrics.num_steps
        off += out.metrics.num_steps_speculation_off
    return {"tok_s": tokens / (time.perf_counter() - started), "acc": tokens / steps, "off": off / steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("systems", nargs="+")
    p.add_argument("--dataset", default="benchmarks/diverse.jsonl")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--alone", help=argparse.SUPPRESS)  # the child process's own system
    args = p.parse_args()
    if args.alone:
        print(json.dumps(run_alone(args.alone, args.dataset, args.max_tokens)))
        return
    if args.systems[0] != "plain":
        raise SystemExit("the first system must be plain: each round's ratios are against it")
    print("| round | system | tok/s | vs plain | acc. len | off |")
    print("|---|---|---|---|---|---|")
    for r in range(1, args.rounds + 1):
        base = None
        for system in args.systems:
            child = subprocess.run([sys.executable, __file__, "plain", "--alone", system, "--dataset", args.dataset,
                                    "--max-tokens", str(args.max_tokens)], capture_output=True, text=True, check=True)
            got = json.loads(child.stdout.strip().splitlines()[-1])
            base = base or got["tok_s"]
            print(f"| {r} | {system} | {got['tok_s']:.1f} | {got['tok_s'] / base:.2f}x | {got['acc']:.2f} "
                  f"| {got['off']:.0%} |", flush=True)


if __name__ == "__main__":
    main()
