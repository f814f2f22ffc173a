#!/usr/bin/env bash
# The one-call GPU check (issue 6): CUDA-marked tests, the 2-process distributed tests and the throughput
# benchmark, in under 10 minutes, with one summary file: ${OUT:-gpu_results}/gpu_check.md (+ logs, JSON).
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#
# Python: $PYTHON if set, else the first of python3 / .venv/bin/python whose torch sees a GPU (a lent machine's
# system python3 already holds a CUDA torch: nothing is installed or downloaded). scratchlm runs from src/ via
# PYTHONPATH. Without a CUDA-capable torch it says so and exits 3 at once (nothing here needs the CPU suite).
# Exit status: 0 all passed, 1 a test step failed, 3 no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
mkdir -p "$OUT"
SUMMARY="$OUT/gpu_check.md"

has_cuda() { "$1" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; }

PY=""
for candidate in ${PYTHON:-} python3 .venv/bin/python; do
    if command -v "$candidate" >/dev/null 2>&1 && has_cuda "$candidate"; then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no Python with a CUDA-enabled torch that sees a GPU (tried: ${PYTHON:-} python3 .venv/bin/python);" \
         "nothing to check here. Run the CPU suite with scripts/test.sh." >&2
    exit 3
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

status=0
step() {  # step NAME TIMEOUT_S COMMAND...: run, log to $OUT/NAME.log, record the verdict
    local name="$1" limit="$2"; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local code=$?
    local verdict="ok"; [ "$code" -eq 0 ] || { verdict="FAILED (exit $code)"; status=1; }
    [ "$code" -eq 124 ] && verdict="TIMED OUT after ${limit}s"
    echo "| $name | $verdict | $((SECONDS - start)) s | $(tail -n 1 "$OUT/$name.log" | tr '|' '/') |" >>"$SUMMARY.rows"
    echo "gpu_check: $name: $verdict ($((SECONDS - start)) s)"
}

rm -f "$SUMMARY.rows"
device=$("$PY" -c "import torch; print(torch.cuda.get_device_name(), '| torch', torch.__version__, '| CUDA', torch.version.cuda)")
echo "gpu_check: $device (python: $PY)"
step pytest_cuda 270 "$PY" -m pytest -m cuda tests -q -p no:cacheprovider
step pytest_distributed 120 "$PY" -m pytest tests/test_distributed.py -q -p no:cacheprovider
step gpu_throughput 200 "$PY" benchmarks/gpu_throughput.py --seconds 20 --out "$OUT/gpu_throughput.json"

{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo
    echo "Device: $device; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)."
    echo
    echo "| step | result | time | last line |"
    echo "|---|---|---|---|"
    cat "$SUMMARY.rows"
    echo
    if [ -f "$OUT/gpu_throughput.md" ]; then sed 's/^# /## /' "$OUT/gpu_throughput.md"; fi
} >"$SUMMARY"
rm -f "$SUMMARY.rows"
echo
cat "$SUMMARY"
exit "$status"
