#!/usr/bin/env bash
# specdec's default CPU target (quantization auto: the embedded GGUF's own Q4_1 blocks times
# 8-bit activations on the integer-dot kernels, the forward compiled) against llama.cpp on
# the same file, beside the dequantized bfloat16 model and the eager forward (BENCHMARKS.md,
# "Against llama.cpp"): the built-in categories at batch 1 (3 repetitions), the diverse
# prompts at batch 1, the built-in categories at batch 8 (llama.cpp decodes the 8 together
# through its bindings' batch API, its prompt lookup serves them one after another).
# Greedy, 2 threads.
# Usage: bash scripts/bench_quantized.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_quantized.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
bench() { .venv/bin/specdec bench --llama-cpp --threads 2 --max-tokens "$tokens" "$@"; }
bench benchmarks/plain_bf16.yaml benchmarks/plain_eager.yaml ngram mtp eagle3 benchmarks/ngram_eager.yaml \
    --repetitions 3 --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
bench benchmarks/plain_bf16.yaml benchmarks/plain_eager.yaml ngram mtp eagle3 \
    --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1.json" > "$out/diverse_b1.txt"
bench benchmarks/plain_eager.yaml ngram benchmarks/ngram_eager.yaml --batch-size 8 \
    --json "$out/builtin_b8.json" > "$out/builtin_b8.txt"
