#!/usr/bin/env bash
# Create ./.venv (if missing) and install scratchlm into it with its test extras.
# The CPU torch wheel is installed FIRST: a bare `torch` requirement in a fresh venv would pull a
# multi-GB CUDA build. Set SCRATCHLM_TORCH to choose another torch (e.g. "torch" on a CUDA machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${SCRATCHLM_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
