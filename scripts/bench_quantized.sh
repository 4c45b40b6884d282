#!/usr/bin/env bash
# specdec's default CPU target (quantization auto: the embedded GGUF's own Q4_1 blocks times
# 8-bit activations on the integer-dot kernels) against llama.cpp on the same file, beside
# the dequantized bfloat16 model and the compiled forward (BENCHMARKS.md, "Against
# llama.cpp"): the built-in categories at batch 1 (3 repetitions), the diverse prompts at
# batch 1, the built-in categories at batch 8 (llama.cpp serves the 8 one after another:
# its Python bindings decode one sequence at a time). Greedy, 2 threads.
# Usage: bash scripts/bench_quantized.sh OUT_DIR [MAX_TOKENS]
set -euo pipefail
out=${1:?usage: bench_quantized.sh OUT_DIR [MAX_TOKENS]}
tokens=${2:-128}
mkdir -p "$out"
bench() { .venv/bin/specdec bench --llama-cpp --threads 2 --max-tokens "$tokens" "$@"; }
bench benchmarks/plain_bf16.yaml ngram mtp eagle3 benchmarks/plain_compiled.yaml benchmarks/ngram_compiled.yaml \
    --repetitions 3 --json "$out/builtin_b1.json" > "$out/builtin_b1.txt"
bench benchmarks/plain_bf16.yaml ngram benchmarks/plain_compiled.yaml benchmarks/ngram_compiled.yaml \
    --dataset benchmarks/diverse.jsonl --json "$out/diverse_b1.json" > "$out/diverse_b1.txt"
bench ngram benchmarks/plain_compiled.yaml benchmarks/ngram_compiled.yaml --batch-size 8 \
    --json "$out/builtin_b8.json" > "$out/builtin_b8.txt"
