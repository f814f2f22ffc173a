#!/usr/bin/env bash
# Create ./.venv (if missing) and install scratchlm into it with its test extras (~10 s when it already exists).
#
# torch is installed FIRST, as `pip install torch==2.13.0`, so that `-e ".[test]"` finds it satisfied. Which
# build that gives depends on pip's configuration, not on this script:
# - on this project's development/CI machines, pip's config has find-links=/opt/wheels, which holds
#   torch-2.13.0+cpu; that wheel satisfies ==2.13.0 and pip prefers it (2.13.0+cpu sorts above 2.13.0), so the
#   CPU build is installed (CI here cannot reach download.pytorch.org, hence no --index-url by default);
# - anywhere else PyPI serves torch 2.13.0 for Linux x86-64 as the CUDA build (several GB of nvidia-* wheels).
#   For the CPU build there, set SCRATCHLM_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu (passed to that
#   one install as --index-url; unset by default).
# SCRATCHLM_TORCH replaces the requirement itself (default torch==2.13.0). The build installed is printed at
# the end (version, and the CUDA version compiled in or "CPU only"), so a surprise is visible.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
TORCH_INDEX=()
[ -z "${SCRATCHLM_TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$SCRATCHLM_TORCH_INDEX_URL")
.venv/bin/python -m pip install --quiet --disable-pip-version-check "${TORCH_INDEX[@]}" \
    "${SCRATCHLM_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[test]"
.venv/bin/python -c 'import torch
print(f"setup_venv: torch {torch.__version__},",
      f"CUDA {torch.version.cuda} compiled in" if torch.version.cuda else "CPU only (no CUDA compiled in)")'
