#!/usr/bin/env bash
# The adaptive planner against plain decoding and fixed draft lengths (BENCHMARKS.md,
# "Speculation that never loses"): every shipped method at its defaults, on the built-in
# categories and the diverse set, batch 1 (with Hugging Face generate() and its prompt
# lookup) and batch 8 (8 distinct concurrent requests). plain_again is plain decoding run a
# second time, interleaved like a method: the noise. ngram_fixed / ngram_k4 / eagle3_fixed
# are the fixed draft lengths the adaptive default is held against.
# Usage: bash scripts/bench_adaptive.sh OUT_DIR [MAX_TOKENS] [REPETITIONS]
# (the diverse set at batch 1 runs once: its 16 prompts are 16 draws already)
set -euo pipefail
out=${1:?usage: bench_adaptive.sh OUT_DIR [MAX_TOKENS] [REPETITIONS]}
tokens=${2:-96}
reps=${3:-2}
mkdir -p "$out"
specdec=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens")
all=(benchmarks/plain_again.yaml ngram benchmarks/ngram_fixed.yaml benchmarks/ngram_k4.yaml lookahead draft_target
     eagle benchmarks/eagle3_fixed.yaml eagle3 medusa mtp redrafter)
"${specdec[@]}" "${all[@]}" --batch-size 8 --repetitions "$reps" --json "$out/builtin_b8.json" > "$out/builtin_b8.txt"
"${specdec[@]}" "${all[@]}" --dataset benchmarks/diverse.jsonl --batch-size 8 --repetitions "$reps" \
    --json "$out/diverse_b8.json" > "$out/diverse_b8.txt"
"${specdec[@]}" "${all[@]}" --hf --repetitions "$reps" --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
"${specdec[@]}" "${all[@]}" --dataset benchmarks/diverse.jsonl --hf --json "$out/diverse_b1.json" \
    > "$out/diverse_b1.txt"
