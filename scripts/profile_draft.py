"""What one draft level costs against a target decode step, per method, on the default target.

    .venv/bin/python scripts/profile_draft.py eagle3 mtp medusa redrafter eagle draft_target \\
        [eagle3=.train/eagle3] [--dataset benchmarks/diverse.jsonl] [--prompts 6] [--max-tokens 64]

A method given as ``name=DIR`` drafts with the drafter trained in DIR (``speculative_model``).

Each method runs the prompts one at a time with the planner off (every step drafts the
method's default shape), beside plain decoding of the same prompts, interleaved prompt by
prompt. Prints, per method: the target step (plain decoding's seconds a token), drafting's
seconds per drafted level (the drafter's ``prepare_draft_tokens`` time over the levels it
was asked for, catching up on accepted rows included), that level as a share of a target
step, the draft module's own share of drafting (its forwards through the draft runner,
where the method has one), and the acceptance length at that shape.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.prompt_sets import load_jsonl


def timed_runner(llm: LLM) -> list[float]:
    """Seconds spent in the drafter's draft-runner forwards, accumulated as it drafts."""
    spent = [0.0]
    runner = getattr(llm.drafter, "runner", None)
    if runner is None:
        return spent
    forward = runner.forward

    def timed(inputs):
        started = time.perf_counter()
        try:
            return forward(inputs)
        finally:
            spent[0] += time.perf_counter() - started

    runner.forward = timed
    return spent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("methods", nargs="+", metavar="METHOD[=DIR]")
    p.add_argument("--dataset", default="benchmarks/diverse.jsonl")
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-prepack", action="store_true",
                   help="engine.prepack_weights off: the drafters' bfloat16 layers on the stock product")
    p.add_argument("--draft-quantization", default="auto", choices=("auto", "none", "w8a8"),
                   help="engine.draft_quantization: the drafters' linear layers on the integer-dot kernels (w8a8)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prompts = [c for convs in load_jsonl(args.dataset).values() for c in convs][:args.prompts]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    engine = {"draft_quantization": args.draft_quantization, **({"prepack_weights": False} if args.no_prepack else {})}
    plain = LLM(engine=engine)
    llms = {}
    for m in args.methods:
        name, _, directory = m.partition("=")
        spec = {"decoding_type": name, "adaptive": False, **({"speculative_model": directory} if directory else {})}
        llms[m] = LLM(speculative_config=spec, engine=engine)
    module_seconds = {m: timed_runner(llm) for m, llm in llms.items()}
    for llm in (plain, *llms.values()):  # first calls pay one-off costs
        llm.chat([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    for spent in module_seconds.values():
        spent[0] = 0.0
    plain_seconds = plain_tokens = 0.0
    totals = {m: {"draft": 0.0, "levels": 0, "steps": 0, "tokens": 0, "wall": 0.0} for m in llms}
    for prompt in prompts:
        started = time.perf_counter()
        out = plain.chat([prompt], params)[0]
        plain_seconds += time.perf_counter() - started
        plain_tokens += len(out.token_ids)
        for m, llm in llms.items():
            started = time.perf_counter()
            got = llm.chat([prompt], params)[0]
            t, metrics = totals[m], got.metrics
            t["wall"] += time.perf_counter() - started
            t["draft"] += metrics.draft_time
            t["levels"] += sum(d * n for d, n in enumerate(metrics.draft_len_counts))
            t["steps"] += metrics.num_steps
            t["tokens"] += len(got.token_ids)
            assert got.token_ids == out.token_ids, f"{m}: output departs from plain decoding"
    step = plain_seconds / plain_tokens
    print(f"target decode step (plain): {step * 1e3:.2f} ms ({plain_tokens / plain_seconds:.1f} tok/s)")
    print("| method | ms a drafted level | level / target step | draft module's share | acc. len | vs plain |")
    print("|---|---|---|---|---|---|")
    for m, t in totals.items():
        level = t["draft"] / max(t["levels"], 1)
        module = module_seconds[m][0] / t["draft"] if t["draft"] and module_seconds[m][0] else float("nan")
        speed = (t["tokens"] / t["wall"]) / (plain_tokens / plain_seconds)
        print(f"| {m} | {level * 1e3:.2f} | {level / step:.0%} | {module:.0%} | {t['tokens'] / t['steps']:.2f} "
              f"| {speed:.2f}x |")


if __name__ == "__main__":
    main()
