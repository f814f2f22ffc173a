#!/usr/bin/env bash
# The main job end to end on the default corpus: tokenizer -> encoded data -> short training run -> sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
exec .venv/bin/scratchlm demo "$@"
