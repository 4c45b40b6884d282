#!/usr/bin/env bash
# The GPU checks of a session lent a device machine, as one prepared run.
#
#   bash scripts/device_check.sh prepare        # here: the wheels the device image lacks, into .whl/
#   bash scripts/device_check.sh run [SECONDS]  # there (device tool: carry .whl; $OUT set)
#
# `run` installs specdec and its plugins from the tree (9 s), runs the kernel and CUDA
# graph tests, the suite eagerly and with every CUDA engine graphed (`--cuda-graphs`),
# each for at most SECONDS (default 150; the embedded model is not carried, its tests
# fail with ModelLoadError and are filtered out of the summary), then the GPU timings
# with graphs beside eager and Hugging Face generate().
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 -d .whl attrs==26.1.0 cattrs==26.2.1 stevedore==5.10.0 platformdirs==4.14.8 \
        gguf==0.19.0
    ;;
run)
    seconds=${2:-150}
    export PYTHONUNBUFFERED=1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
            --target /tmp/site . plugins/spec_* || exit 1
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_kernels.py 2>&1 | tail -5
    for mode in eager graphs; do
        flag=$([ $mode = graphs ] && echo --cuda-graphs)
        timeout "$seconds" python3 -m pytest -q -p no:cacheprovider -p no:benchmark $flag -n 12 --dist loadfile \
            --timeout 120 -rfE --deselect tests/test_cpu_linear.py::test_shapes_the_kernel_does_not_take_stay_with_torch \
            tests plugins examples > "$OUT/suite_$mode.log" 2>&1
        echo "== suite, $mode: rc $?; $(tail -1 "$OUT/suite_$mode.log")"
        grep -E '^(FAILED|ERROR)' "$OUT/suite_$mode.log" | grep -v ModelLoadError | cut -c1-200
    done
    python3 scripts/gpu_timings.py --shape llama-8b --parts steps,generate,eagle3 --cuda-graphs --batches 1,8,32 \
        --repeats 2 --new-tokens 64 --steps 10 --kv-cache-mb 8192 --json "$OUT/timings.json" 2>&1 \
        | grep -E '^(steps|generate|eagle3|#)'
    ;;
*)
    echo "usage: $0 prepare | run [SECONDS]" >&2
    exit 2
    ;;
esac
