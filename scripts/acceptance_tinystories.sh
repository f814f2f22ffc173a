#!/usr/bin/env bash
# Real-data acceptance run (issue: training a user can trust): on the shared TinyStories text, train the 10k
# tokenizer, encode train/valid, train the CPU-sized preset (~20 minutes on 2 cores), evaluate, and sample.
# Results are summarised in docs/acceptance-tinystories.md.
#
#   bash scripts/acceptance_tinystories.sh [TRAIN ARGS...]    # e.g. --set train.max_steps=50 --run-dir runs/x
#
# The run directory is runs/tinystories-cpu, or $RUN_DIR, or --run-dir DIR (--run-dir=DIR) among the arguments;
# train, eval and generate all use that one directory. The other arguments go to `scratchlm train` only (use
# --run-dir or RUN_DIR, not --set train.run_dir=..., to move the run). Text comes from $SCRATCHLM_DATA_DIR,
# else ../shared/data. It runs scripts/setup_venv.sh first, so a clean checkout needs nothing else.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${RUN_DIR:-runs/tinystories-cpu}"
TRAIN_ARGS=()
while (($#)); do
    case "$1" in
        --run-dir) [[ $# -ge 2 ]] || { echo "acceptance_tinystories.sh: --run-dir needs a directory" >&2; exit 2; }
                   RUN_DIR="$2"; shift 2 ;;
        --run-dir=*) RUN_DIR="${1#--run-dir=}"; shift ;;
        *train.run_dir=*) echo "acceptance_tinystories.sh: give the run directory as --run-dir DIR or RUN_DIR=DIR" \
                               "(eval and generate use it too), not $1" >&2; exit 2 ;;
        *) TRAIN_ARGS+=("$1"); shift ;;
    esac
done
bash scripts/setup_venv.sh  # ./.venv with scratchlm (a few seconds when it is already there)
DATA="${SCRATCHLM_DATA_DIR:-../shared/data}"
OUT=out/tinystories
mkdir -p "$OUT"
S=.venv/bin/scratchlm
echo "acceptance_tinystories.sh: run directory $RUN_DIR"
$S tokenizer train --input "$DATA/tinystories/TinyStories-train.txt" --vocab-size 10000 \
    --special-token '<|endoftext|>' --out "$OUT/tokenizer"
$S data encode --tokenizer "$OUT/tokenizer" --input "$DATA/tinystories/TinyStories-train.txt" --out "$OUT/train.tok"
$S data encode --tokenizer "$OUT/tokenizer" --input "$DATA/tinystories/TinyStories-valid.txt" --out "$OUT/valid.tok"
$S train --config configs/tinystories-cpu.toml "${TRAIN_ARGS[@]}" --run-dir "$RUN_DIR"
$S eval --checkpoint "$RUN_DIR" --data "$OUT/valid.tok"
$S generate --checkpoint "$RUN_DIR" --prompt "Once upon a time" --max-new-tokens 200 \
    --temperature 0.8 --top-p 0.9 --seed 0
