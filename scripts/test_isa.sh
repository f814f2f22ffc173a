#!/usr/bin/env bash
# The speed paths' tests again as a CPU with fewer vector instructions runs them, on whatever CPU this is:
#   bash scripts/test_isa.sh avx2      # as an AVX2-only CPU: torch dispatching at AVX2 (ATEN_CPU_CAPABILITY) and
#                                      # oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA): no bf16 arithmetic
#   bash scripts/test_isa.sh default   # as a CPU without AVX2: torch's plain kernels, oneDNN held to SSE4.1
# so that an AVX-512 machine proves the paths of the machines most people have. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    avx2) export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ;;
    default) export ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 ;;
    *) echo "usage: bash scripts/test_isa.sh avx2|default [pytest arguments]" >&2; exit 2 ;;
esac
shift
bash scripts/setup_venv.sh
exec .venv/bin/python -m pytest -n 2 tests/test_kernels.py tests/test_decode_step.py tests/test_compiled_step.py \
    tests/test_generate.py tests/test_serve_engine.py tests/test_serve.py tests/test_serve_process.py \
    tests/test_precision.py tests/test_hf_parity.py "$@"
