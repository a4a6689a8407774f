#!/usr/bin/env bash
# The first GPU run of the trainer (issue 19) in one command, under 8 minutes on one H100/H200:
# NanoColibri, bf16, --compile, seq 2048, the micro-batch the memory planner says fits, random
# (learnable) tokens for up to 300 steps; prints tokens/s, MFU, peak memory against the planner,
# host syncs per step and the loss going down (bench/gpu_check.py does the run).
#
#   bench/gpu_check.sh              on the GPU machine (python3 with torch >= 2.11 and CUDA)
#   bench/gpu_check.sh --cpu-smoke  the same code, tiny preset on CPU, in seconds (make gpu-check-smoke)
#   other arguments go to bench/gpu_check.py (e.g. --steps 100, --micro-batch 4, --no-compile)
#
# Sets up what the machine lacks, offline: pydantic and its dependencies from the wheels in
# $COLIBRI_WHEELS (default .whl/, made here by `make gpu-wheels` and carried to the machine),
# installed into a private folder; the colibri packages run from the working tree (PYTHONPATH),
# so the machine's own torch is used whatever the packages' declared range. Output: the log and
# the JSON report in $OUT (or /tmp) as gpu_check.log / gpu_check.json.
# Exit status: 0 ok, 1 a check failed (no fit, loss not down), 2 bad usage or setup.
set -uo pipefail
cd "$(dirname "$0")/.."

smoke=0
for arg in "$@"; do
    case "$arg" in
        --cpu-smoke) smoke=1 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    esac
done

if [ -n "${PYTHON:-}" ]; then py="$PYTHON"
elif [ "$smoke" = 1 ] && [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
out_dir="${OUT:-/tmp}"
mkdir -p "$out_dir"

if ! "$py" -c "import pydantic" 2>/dev/null; then
    wheels="${COLIBRI_WHEELS:-.whl}"
    if ! ls "$wheels"/pydantic-*.whl >/dev/null 2>&1; then
        echo "gpu_check: $py has no pydantic and $wheels/ holds no pydantic wheel (run 'make gpu-wheels' where pip works, and carry $wheels)" >&2
        exit 2
    fi
    site="$(mktemp -d /tmp/colibri-site.XXXXXX)"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$wheels"/*.whl || {
        echo "gpu_check: installing the wheels in $wheels/ failed" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/packages/colibri-model/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1

if [ "$smoke" = 0 ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1 | head -3
fi
"$py" -c "import torch, pydantic, colibri_model; print('python', __import__('sys').version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'pydantic', pydantic.VERSION)" || {
    echo "gpu_check: the environment cannot import torch, pydantic and colibri_model" >&2; exit 2; }

# A hard stop a little under the 8 minutes, so that a hang still leaves the log behind.
limit=$([ "$smoke" = 1 ] && echo 300 || echo 450)
timeout "$limit" "$py" -u bench/gpu_check.py "$@" --json-out "$out_dir/gpu_check.json" 2>&1 | tee "$out_dir/gpu_check.log"
status=${PIPESTATUS[0]}
[ "$status" = 124 ] && echo "gpu_check: stopped after ${limit}s" >&2
exit "$status"
