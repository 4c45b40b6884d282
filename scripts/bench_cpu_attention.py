"""The torch reference attention on CPU: padded rows per width group against the packed
dense mask it replaced (every query over the whole batch's keys), plain and ngram decoding
at batch 8, interleaved, two rounds (BENCHMARKS.md). Each mode has its own engines, so
no ngram pool carries one mode's answers into the other's run.

    .venv/bin/python scripts/bench_cpu_attention.py

The dense path is still what one sequence, sliding windows, soft-capping and pending draft
nodes use; here it is forced for every step by reporting pending nodes on every layout.
"""

from __future__ import annotations

import time

import torch

from specdec import LLM, SamplingParams
from specdec.bench.prompt_sets import PROMPTS
from specdec.kvcache.layout import AttentionLayout


def main() -> None:
    torch.set_num_threads(2)
    padded = AttentionLayout.has_pending
    dense = property(lambda self: True)
    specs = {"plain": None, "ngram": {"decoding_type": "ngram"}}
    llms = {(name, mode): LLM(dtype="bfloat16", speculative_config=spec)
            for name, spec in specs.items() for mode in ("dense", "padded")}
    params = SamplingParams(max_tokens=64, temperature=0)
    print(f"{'round':<7}{'category':<16}{'method':<8}{'dense tok/s':>12}{'padded tok/s':>14}{'ratio':>8}")
    for round_ in range(2):
        for cat in ("chat", "summarization"):
            chat = [[{"role": "user", "content": f"(request {i}) {PROMPTS[cat][0]}"}] for i in range(8)]
            prompts = [llms["plain", "dense"].apply_chat_template(c) for c in chat]
            for name in specs:
                rates = {}
                for mode, prop in (("dense", dense), ("padded", padded)):
                    AttentionLayout.has_pending = prop
                    started = time.perf_counter()
                    outs = llms[name, mode].generate(prompts, params)
                    rates[mode] = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - started)
                print(f"{round_:<7}{cat:<16}{name:<8}{rates['dense']:>12.1f}{rates['padded']:>14.1f}"
                      f"{rates['padded'] / rates['dense']:>7.2f}x")
    AttentionLayout.has_pending = padded


if __name__ == "__main__":
    main()
