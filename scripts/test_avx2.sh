#!/usr/bin/env bash
# The speed paths' tests again as an AVX2-only CPU runs them, on whatever CPU this is: torch dispatching as an
# AVX2 CPU would (ATEN_CPU_CAPABILITY=avx2) and oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), so that an AVX-512
# machine proves the paths of the machines most people have (no bf16 arithmetic: the plain and float32 paths).
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
exec .venv/bin/python -m pytest -n 2 tests/test_kernels.py tests/test_decode_step.py tests/test_compiled_step.py \
    tests/test_generate.py tests/test_serve_engine.py tests/test_serve.py tests/test_serve_process.py \
    tests/test_precision.py tests/test_hf_parity.py "$@"
