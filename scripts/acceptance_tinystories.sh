#!/usr/bin/env bash
# Real-data acceptance run (issue: training a user can trust): on the shared TinyStories text, train the 10k
# tokenizer, encode train/valid, train the CPU-sized preset (~20 minutes on 2 cores), evaluate, and sample.
# Results are summarised in docs/acceptance-tinystories.md; the run directory is runs/tinystories-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
DATA="${SCRATCHLM_DATA_DIR:-../shared/data}"
OUT=out/tinystories
mkdir -p "$OUT"
S=.venv/bin/scratchlm
$S tokenizer train --input "$DATA/tinystories/TinyStories-train.txt" --vocab-size 10000 \
    --special-token '<|endoftext|>' --out "$OUT/tokenizer"
$S data encode --tokenizer "$OUT/tokenizer" --input "$DATA/tinystories/TinyStories-train.txt" --out "$OUT/train.tok"
$S data encode --tokenizer "$OUT/tokenizer" --input "$DATA/tinystories/TinyStories-valid.txt" --out "$OUT/valid.tok"
$S train --config configs/tinystories-cpu.toml "$@"
$S eval --checkpoint runs/tinystories-cpu --data "$OUT/valid.tok"
$S generate --checkpoint runs/tinystories-cpu --prompt "Once upon a time" --max-new-tokens 200 \
    --temperature 0.8 --top-p 0.9 --seed 0
