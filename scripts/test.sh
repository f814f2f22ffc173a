#!/usr/bin/env bash
# The whole test suite (CUDA-marked tests skip without a GPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
.venv/bin/ruff check src tests benchmarks
exec .venv/bin/python -m pytest -n 2 "$@"
