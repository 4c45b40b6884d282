#!/usr/bin/env bash
# The MTP module shipped for the embedded model (BENCHMARKS.md, "MTP"): 3 drafts every step
# (the configuration: one module reused up to 3), 2 drafts, the adaptive default,
# the lossy relaxed acceptance, and EAGLE-3 and EAGLE-1 for comparison, against plain
# decoding, one interleaved run per prompt set, batch 1, bfloat16, greedy. The
# batch-invariant numerics are on for every system (plain included), so every lossless
# system emits plain decoding's text and no acceptance is inflated by a bfloat16
# divergence; the relaxed run's `same` column shows what its lossy rule changed.
# plain_again is plain decoding run a second time, interleaved like a method: the noise.
# Usage: bash scripts/bench_mtp.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_mtp.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
specdec=(.venv/bin/specdec bench --dtype bfloat16 --threads 2 --max-tokens "$tokens" --set engine.batch_invariant=true)
systems=(benchmarks/plain_again.yaml benchmarks/mtp_fixed.yaml benchmarks/mtp_k2.yaml mtp benchmarks/mtp_relaxed.yaml
         eagle3 eagle)
"${specdec[@]}" "${systems[@]}" --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1.json" \
    > "$out/diverse_b1.txt"
"${specdec[@]}" "${systems[@]}" --categories chat math_reasoning translation --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
