"""What the adaptive planner expected of the drafts it kept, against what the target accepted.

    .venv/bin/python scripts/draft_calibration.py ngram [--dataset benchmarks/diverse.jsonl |
        --categories code_editing qa_over_text] [--batch-size 8] [--max-tokens 96]
        [--threads 2] [--set request_prior_weight=1] [--show-deep 8]

Runs the prompts in batches (greedy, bfloat16) on one engine and, for every draft the
planner kept, records the request's estimate when it was kept (the chance that the first
position is accepted, the expected tokens) and what was accepted. Requests are split in
two classes after the run: those whose drafts were mostly accepted (more than 70% of their
draft tokens: the ones that copy) and the others; per class, kind (ngram: the match length)
and depth (4 and over together) it prints the drafts, the first position's expected and
accepted rate, and the expected and accepted tokens. ``--show-deep N`` also lists the
estimates behind each kept draft of depth N or more of the other class: the request's own
counts per position against the engine-wide rates they lean on.
"""

from __future__ import annotations

import argparse
import collections

import torch

from ab_planner import add_prompt_options, conversations_of, parse_settings, set_planner_attributes
from specdec import LLM, SamplingParams
from specdec.bench import WARMUP


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("method", help="a decoding type")
    add_prompt_options(p)
    p.add_argument("--set", default="", metavar="NAME=VALUE[,NAME=VALUE]", help="planner attributes")
    p.add_argument("--show-deep", type=int, metavar="N", help="list the estimates of the others' drafts of depth >= N")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    conversations = conversations_of(args)
    llm = LLM(dtype="bfloat16", speculative_config={"decoding_type": args.method})
    planner = llm.engine.planner
    if args.set:
        set_planner_attributes(llm, parse_settings(args.set))
    llm.chat([WARMUP], SamplingParams(max_tokens=4, temperature=0.0))
    kept_estimates, drafts, deep = {}, [], []
    trim, observe_verified = planner.trim, planner.observe_verified

    def recording_trim(reqs, proposals, shape):
        kept = trim(reqs, proposals, shape)
        for req, prop in zip(reqs, kept):
            if prop is not None and prop.depth:
                stats = planner.request_stats(req)
                kept_estimates[req.request_id] = (prop.kind, prop.depth, stats.curve(prop.kind, prop.depth))
                if args.show_deep and prop.depth >= args.show_deep:
                    deep.append((req.request_id, prop.kind, prop.depth, stats.rates(prop.kind, prop.depth),
                                 stats.counts.get(prop.kind, []), planner.stats.rates(prop.kind, prop.depth)))
        return kept

    def recording_observe(req, proposal, accepted_nodes):
        kept = kept_estimates.pop(req.request_id, None)
        if kept is not None:
            drafts.append((req.request_id, *kept, len(accepted_nodes)))
        return observe_verified(req, proposal, accepted_nodes)

    planner.trim, planner.observe_verified = recording_trim, recording_observe
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, seed=0)
    outs = []
    for start in range(0, len(conversations), args.batch_size):
        outs += llm.chat(conversations[start:start + args.batch_size], params)
    copying = {o.request_id for o in outs
               if o.metrics.num_draft_tokens and o.metrics.num_accepted_tokens > 0.7 * o.metrics.num_draft_tokens}
    rows = collections.defaultdict(lambda: [0, 0.0, 0, 0.0, 0])
    for request_id, kind, depth, curve, accepted in drafts:
        row = rows[(request_id in copying, str(kind), min(depth, 4))]
        row[0] += 1
        row[1] += curve[0]
        row[2] += accepted >= 1
        row[3] += sum(curve)
        row[4] += accepted
    print(f"# {args.method}, {len(outs)} requests at batch {args.batch_size}, {args.max_tokens} tokens; "
          f"{len(copying)} copy (more than 70% of their draft tokens accepted)")
    print("class   kind  depth  drafts  first position: expected accepted  tokens: expected accepted")
    for (copies, kind, depth), (n, first, first_hits, tokens, hits) in sorted(rows.items()):
        print(f"{'copying' if copies else 'other':7s} {kind:>5s} {('>=4' if depth == 4 else depth)!s:>6s} {n:7d} "
              f"{first / n:25.2f} {first_hits / n:8.2f} {tokens:17.1f} {hits:8d}")
    for request_id, kind, depth, rates, own, engine in deep:
        if request_id not in copying:
            print(f"{request_id} kind {kind} depth {depth}: rates {[round(r, 2) for r in rates[:6]]}, own "
                  f"(reached, accepted) {[(round(a, 1), round(b, 1)) for a, b in own[:6]]}, engine-wide "
                  f"{[round(r, 2) for r in engine[:6]]}")


if __name__ == "__main__":
    main()
