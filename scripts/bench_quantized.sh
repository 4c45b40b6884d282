#!/usr/bin/env bash
# The int4 target (the embedded GGUF's own Q4_1 blocks) against llama.cpp on the same file,
# Hugging Face generate() and specdec's bfloat16 plain decoding, one interleaved run over
# the built-in categories, batch 1, greedy (BENCHMARKS.md, "Quantized targets"). Methods
# run on the int4 target with the adaptive planner (the default): a 16-token verification
# costs about 3.4x a decode step on the int4 kernels, and the planner measures that.
# Usage: bash scripts/bench_quantized.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_quantized.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
.venv/bin/specdec bench benchmarks/plain_bf16.yaml ngram eagle3 mtp --quantization int4 --hf --llama-cpp \
    --dtype bfloat16 --threads 2 --max-tokens "$tokens" --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
