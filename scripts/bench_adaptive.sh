#!/usr/bin/env bash
# The adaptive planner against plain decoding and each method's fixed draft length
# (BENCHMARKS.md, "Speculation that never loses"): built-in categories and the diverse
# set, batch 1 (with Hugging Face generate() and its prompt lookup) and batch 8.
# plain_again is plain decoding run a second time, interleaved like a method: the noise.
# Usage: bash scripts/bench_adaptive.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_adaptive.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-96}
mkdir -p "$out"
specdec=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens")
all=(benchmarks/plain_again.yaml ngram benchmarks/ngram_fixed.yaml benchmarks/ngram_k4.yaml lookahead
     benchmarks/lookahead_fixed.yaml draft_target benchmarks/draft_target_fixed.yaml eagle3 benchmarks/eagle3_fixed.yaml
     benchmarks/eagle3_k2.yaml eagle)
diverse=(benchmarks/plain_again.yaml ngram benchmarks/ngram_fixed.yaml lookahead draft_target eagle3
         benchmarks/eagle3_fixed.yaml)
"${specdec[@]}" "${all[@]}" --hf --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
"${specdec[@]}" "${all[@]}" --batch-size 8 --json "$out/builtin_b8.json" > "$out/builtin_b8.txt"
"${specdec[@]}" "${diverse[@]}" --dataset benchmarks/diverse.jsonl --hf --json "$out/diverse_b1.json" \
    > "$out/diverse_b1.txt"
"${specdec[@]}" "${diverse[@]}" --dataset benchmarks/diverse.jsonl --batch-size 8 --json "$out/diverse_b8.json" \
    > "$out/diverse_b8.txt"
