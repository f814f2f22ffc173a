#!/usr/bin/env bash
# The one-call GPU check (issue 6): CUDA-marked tests, the 2-process distributed tests and the throughput/MFU
# benchmark, with one summary file: ${OUT:-gpu_results}/gpu_check.md (+ one log per step, gpu_throughput.json/.md).
#
#   bash scripts/gpu_check.sh            # on a machine with a CUDA GPU
#
# Worst case: about 445 s (7.5 minutes), so that it fits one 600 s device call with room to spare. Everything, the
# Python probe included, runs against one deadline 440 s after the start (GPU_CHECK_BUDGET_S to change it), and each
# step has its own cap too: pytest -m cuda 150 s, distributed tests 75 s, throughput 230 s (3 shapes: the CS336
# recipe on tinystories-17m and GPT-2 small, the modern recipe on tinystories-17m; warm-up/compile + 10 timed s
# each). A step
# that ignores SIGTERM is killed 10 s later (timeout -k 10; the deadline keeps those 10 s). Results are written
# as they come: the header of gpu_check.md at once, its row as each step ends, each throughput shape's figures
# as that shape ends. A step cut short is reported as TIMED OUT (or SKIPPED when the deadline left it under
# 20 s) and the next step still runs.
#
# Python: $PYTHON if set, else the first of python3 / .venv/bin/python whose torch sees a GPU (a lent machine's
# system python3 already holds a CUDA torch: nothing is installed or downloaded). scratchlm runs from src/ via
# PYTHONPATH. Without a CUDA-capable torch it prints one line saying so and exits 3 at once.
# Exit status: 0 all passed, 1 a step failed, timed out or was skipped, 3 no CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu_results}"
SUMMARY="$OUT/gpu_check.md"
BUDGET="${GPU_CHECK_BUDGET_S:-440}"
KILL_AFTER=10
START=$SECONDS

# probe PY: print "device | torch | CUDA" and exit 0 when this Python's torch sees a GPU (45 s cap: a cold import).
PROBE='import torch, sys
if not torch.cuda.is_available(): sys.exit(1)
print(torch.cuda.get_device_name(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)'

PY="" device="" tried=""
for candidate in ${PYTHON:-python3 .venv/bin/python}; do
    tried="$tried $candidate"
    command -v "$candidate" >/dev/null 2>&1 || continue
    if device=$(timeout -k 5 45 "$candidate" -c "$PROBE" 2>/dev/null); then PY="$candidate"; break; fi
done
if [ -z "$PY" ]; then
    echo "gpu_check: no CUDA GPU visible to any Python tried (${tried# }): torch missing, a CPU-only build, or no" \
         "driver/GPU; nothing to check (exit 3). The CPU suite is bash scripts/test.sh." >&2
    exit 3
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4

# Files of an earlier run in the same folder must not be mistaken for this run's.
rm -f "$SUMMARY" "$OUT"/pytest_cuda.log "$OUT"/pytest_distributed.log "$OUT"/gpu_throughput.{log,json,json.tmp,md}
{
    echo "# GPU check ($(date -u +%Y-%m-%dT%H:%M:%SZ))"
    echo
    echo "Device: $device; python $PY; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown);" \
         "budget ${BUDGET} s."
    echo
    echo "| step | result | time | last line |"
    echo "|---|---|---|---|"
} >"$SUMMARY"
echo "gpu_check: $device (python: $PY; budget ${BUDGET} s)"

status=0
row() {  # row NAME VERDICT SECONDS LAST_LINE: append to the summary at once (survives a later kill)
    echo "| $1 | $2 | $3 s | $(printf '%s' "$4" | tr '|' '/') |" >>"$SUMMARY"
    echo "gpu_check: $1: $2 ($3 s)"
}
step() {  # step NAME CAP_S COMMAND...: run under min(cap, time left), log to $OUT/NAME.log, record the verdict
    local name="$1" limit="$2"; shift 2
    local left=$((BUDGET - (SECONDS - START) - KILL_AFTER))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then
        status=1; row "$name" "SKIPPED (the ${BUDGET} s budget is spent)" 0 ""; return
    fi
    local start=$SECONDS
    timeout -k "$KILL_AFTER" "$limit" "$@" >"$OUT/$name.log" 2>&1
    local code=$?
    local verdict="ok"
    if [ "$code" -eq 124 ] || [ "$code" -eq 137 ]; then verdict="TIMED OUT after ${limit} s"
    elif [ "$code" -ne 0 ]; then verdict="FAILED (exit $code)"; fi
    [ "$code" -eq 0 ] || status=1
    row "$name" "$verdict" "$((SECONDS - start))" "$(tail -n 1 "$OUT/$name.log")"
}

step pytest_cuda 150 "$PY" -m pytest -m cuda tests -q -p no:cacheprovider
step pytest_distributed 75 "$PY" -m pytest tests/test_distributed.py -q -p no:cacheprovider
step gpu_throughput 230 "$PY" benchmarks/gpu_throughput.py --seconds 10 --out "$OUT/gpu_throughput.json"

# The throughput table holds every shape that finished, even when the step was cut short.
if [ -f "$OUT/gpu_throughput.md" ]; then { echo; sed 's/^# /## /' "$OUT/gpu_throughput.md"; } >>"$SUMMARY"; fi
echo "gpu_check: total $((SECONDS - START)) s, exit $status"
echo
cat "$SUMMARY"
exit "$status"
