#!/usr/bin/env bash
# The tables of BENCHMARKS.md's "Where specdec stands": every shipped method at its
# defaults against plain decoding (and plain decoding run again, the run's noise), on the
# built-in categories at batch 1 beside Hugging Face generate(), at batch 8, and on the
# diverse prompt set at batch 1. bfloat16, greedy, interleaved.
# Usage: bash scripts/bench_performance.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_performance.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-96}
mkdir -p "$out"
bench=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens")
methods=(benchmarks/plain_again.yaml ngram lookahead draft_target eagle eagle3 medusa mtp redrafter)
"${bench[@]}" "${methods[@]}" --hf --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
"${bench[@]}" "${methods[@]}" --batch-size 8 --json "$out/builtin_b8.json" > "$out/builtin_b8.txt"
"${bench[@]}" "${methods[@]}" --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1.json" \
    > "$out/diverse_b1.txt"
