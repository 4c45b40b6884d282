"""The shapes of a method's steps on a prompt set, and what the target forward took for each.

    .venv/bin/python scripts/step_shapes.py medusa [--batch-size 8] [--max-tokens 96]
        [--dataset benchmarks/diverse.jsonl | --category summarization] [--probe-share 0.03] [--off]
        [--batch-invariant] [--cold] [--one-at-a-time] [--compile] [--quantization int4]

Runs the first ``--batch-size`` prompts of the set together (greedy, bfloat16, 2 threads)
and prints the steps, those where some request verified a draft, the target tokens beside
the prompt and decoding tokens (drafts and lookahead's window: what speculation added),
and per decode-step shape (sequences, target tokens, widest sequence) the median forward
time. ``--off`` keeps the method's engine (hidden-state capture, the states kept for cached prefixes) with
speculation off (``draft_len_schedule {1: 0}``): the baseline its steps with drafts are
measured against. ``step ms`` is the whole step as the engine times it for its cost model
(drafting excluded), ``predicted ms`` what the cost model expected of that step just before
it learnt from it (0 without the adaptive planner). ``--probe-share`` sets the adaptive planner's probe budget (``1e9``:
none). ``--cold`` skips the warm-up request, so the planner starts on the batch itself,
as an engine does on its first requests. ``--one-at-a-time`` runs the prompts one after
another, each alone (batch 1), the planner's state carried from one to the next as in a
server. ``--compile`` and ``--quantization`` set the engine's options of those names (the
compiled int4 target of BENCHMARKS.md's llama.cpp comparison). What the adaptive planner's
cost model has to learn is in these numbers.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench import concurrent_requests
from specdec.prompt_sets import load_jsonl, messages


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("method", help="a decoding type, or plain")
    p.add_argument("--dataset", default="benchmarks/diverse.jsonl")
    p.add_argument("--category", help="a built-in category of specdec bench instead of --dataset, its "
                   "requests made distinct as the bench makes them")
    p.add_argument("--cold", action="store_true", help="no warm-up request: the planner starts on the batch itself")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--probe-share", type=float)
    p.add_argument("--off", action="store_true", help="the method's engine with speculation off")
    p.add_argument("--batch-invariant", action="store_true")
    p.add_argument("--one-at-a-time", action="store_true", help="the prompts one after another, each alone")
    p.add_argument("--compile", action="store_true", help="compile the target forward (engine.compile)")
    p.add_argument("--quantization", choices=["int8", "int4"], help="weight-only quantized target")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    spec = None if args.method == "plain" else {"decoding_type": args.method}
    if spec and args.off:
        spec["draft_len_schedule"] = {1: 0}
    llm = LLM(dtype="bfloat16", speculative_config=spec, engine={
        "batch_invariant": args.batch_invariant, "compile": args.compile, "quantization": args.quantization})
    engine = llm.engine
    if args.probe_share is not None:
        engine.planner.probe_share = args.probe_share
    if args.category:
        conversations = concurrent_requests(messages(args.category), args.batch_size)
    else:
        conversations = [c for convs in load_jsonl(args.dataset).values() for c in convs][:args.batch_size]
    prompts = [llm.apply_chat_template(c) for c in conversations]
    steps, forward = [], engine._forward

    def timed_forward(items):
        started = time.perf_counter()
        out = forward(items)
        prefill = any(it.is_prefill for it in items)
        drafted = any(it.proposal is not None for it in items)
        steps.append((prefill, drafted, len(items), sum(len(it.tokens) for it in items),
                      max(len(it.tokens) for it in items), time.perf_counter() - started,
                      sum(len(it.tokens) - 1 for it in items if not it.is_prefill)))
        return out

    engine._forward = timed_forward
    planned = []  # per step: what the engine timed (drafting excluded) and what the cost model expected
    if engine.planner is not None:
        observe = engine.planner.observe_step

        def observing(num_tokens, work, seconds, widest):
            planned.append((seconds, engine.planner.costs.step_seconds(num_tokens, work, widest)))
            observe(num_tokens, work, seconds, widest)

        engine.planner.observe_step = observing
    if not args.cold:
        llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0))  # warm-up, not counted
    steps.clear()
    planned.clear()
    for group in [[prompt] for prompt in prompts] if args.one_at_a_time else [prompts]:
        llm.generate(group, SamplingParams(max_tokens=args.max_tokens, temperature=0))
    target_tokens, added = sum(s[3] for s in steps), sum(s[6] for s in steps)
    batch = f"{args.batch_size} prompts one at a time" if args.one_at_a_time else f"batch {args.batch_size}"
    print(f"# {args.method}{' (speculation off)' if args.off else ''}, {batch}, "
          f"{args.max_tokens} tokens: {len(steps)} steps, {sum(s[1] for s in steps)} with drafts; "
          f"{target_tokens} target tokens, {added} of them drafts and windows (beside each request's last token)")
    shapes = collections.defaultdict(list)
    for i, (prefill, _, seqs, tokens, widest, seconds, _) in enumerate(steps):
        if not prefill:
            shapes[(seqs, tokens, widest)].append((seconds, *(planned[i] if planned else (0.0, 0.0))))
    print("sequences  tokens  widest  steps  median forward ms  step ms  predicted ms")
    for (seqs, tokens, widest), times in sorted(shapes.items()):
        forward_ms, step_ms, predicted_ms = (1000 * statistics.median(t) for t in zip(*times))
        print(f"{seqs:>9} {tokens:>7} {widest:>7} {len(times):>6} {forward_ms:>18.1f} {step_ms:>8.1f} "
              f"{predicted_ms:>13.1f}")


if __name__ == "__main__":
    main()
