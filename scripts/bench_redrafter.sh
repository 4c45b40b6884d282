#!/usr/bin/env bash
# ReDrafter's shipped drafter (BENCHMARKS.md, "ReDrafter"): the default (adaptive) and the
# beam sweep drafted every step (width 1/2/4/8 at 4 drafts, width 4 at 3 drafts), with
# Medusa and EAGLE-1 (the other heads on the target's last state) and plain decoding, one
# interleaved run per prompt set, batch 1, bfloat16, greedy. The batch-invariant numerics
# are on for every system (plain included), so all of them emit the same text and no
# acceptance is inflated by a bfloat16 divergence (BENCHMARKS.md, "Bit-exact bfloat16").
# A last run repeats the diverse set with the stock numerics and the beam width left to vary
# under the adaptive planner (its speedups may be inflated where bfloat16 outputs diverge:
# the `same` column says where).
# plain_again is plain decoding run a second time, interleaved like a method: the noise.
# Usage: bash scripts/bench_redrafter.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_redrafter.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
specdec=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens" --set engine.batch_invariant=true)
systems=(benchmarks/plain_again.yaml redrafter benchmarks/redrafter_fixed.yaml benchmarks/redrafter_w1.yaml
         benchmarks/redrafter_w2.yaml benchmarks/redrafter_w8.yaml benchmarks/redrafter_l3.yaml medusa eagle)
"${specdec[@]}" "${systems[@]}" --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
"${specdec[@]}" benchmarks/plain_again.yaml redrafter benchmarks/redrafter_fixed.yaml medusa eagle eagle3 \
    --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1.json" > "$out/diverse_b1.txt"
"${specdec[@]}" benchmarks/plain_again.yaml redrafter benchmarks/redrafter_fixed.yaml --batch-size 8 \
    --dataset benchmarks/diverse.jsonl --json "$out/diverse_b8.json" > "$out/diverse_b8.txt"
.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens" --set engine.batch_invariant=false \
    benchmarks/plain_again.yaml redrafter benchmarks/redrafter_w2_adaptive.yaml benchmarks/redrafter_w1_adaptive.yaml \
    medusa eagle3 --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1_stock.json" > "$out/diverse_b1_stock.txt"
