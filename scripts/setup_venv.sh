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
# Every other script that makes a venv does it through the same scripts/lib/venv.sh.
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
make_venv .venv -e ".[test]"
.venv/bin/python -c 'import torch
print(f"setup_venv: torch {torch.__version__},",
      f"CUDA {torch.version.cuda} compiled in" if torch.version.cuda else "CPU only (no CUDA compiled in)")'
