#!/usr/bin/env bash
# The batch-invariant numerics mode (BENCHMARKS.md, "Bit-exact bfloat16"): its cost against
# the stock numerics, interleaved (built-in categories, batch 1 and 8), and how many
# speculative outputs equal plain decoding's on the diverse set (16 prompts, 8 concurrent
# requests at a time) with it (the cost runs' `same` column shows the stock numerics').
# The batch-1 run also measures Medusa's shipped heads as a chain and as trees
# (BENCHMARKS.md, "Medusa").
# plain_again is plain decoding run a second time, interleaved like a method: the noise.
# Usage: bash scripts/bench_invariant.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_invariant.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
# the stock numerics as the run's setting; the *_invariant YAML files turn the mode on
specdec=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens" --set engine.batch_invariant=false)
cost=(benchmarks/plain_again.yaml benchmarks/plain_invariant.yaml ngram benchmarks/ngram_invariant.yaml
      eagle3 benchmarks/eagle3_invariant.yaml)
methods=(ngram lookahead draft_target eagle eagle3 medusa)
medusa=(medusa benchmarks/medusa_fixed.yaml benchmarks/medusa_chain.yaml benchmarks/medusa_wide.yaml)
"${specdec[@]}" "${cost[@]}" "${medusa[@]}" --json "$out/cost_b1.json" > "$out/cost_b1.txt"
"${specdec[@]}" "${cost[@]}" --batch-size 8 --json "$out/cost_b8.json" > "$out/cost_b8.txt"
"${specdec[@]}" "${methods[@]}" --dataset benchmarks/diverse.jsonl --batch-size 8 \
    --set engine.batch_invariant=true --json "$out/identity_invariant.json" > "$out/identity_invariant.txt"
