#!/usr/bin/env bash
# The HF interop tests under the transformers versions we promise, beside the pinned one the suite uses:
# - the LOWEST supported transformers (the floor of the [hf] extra in pyproject.toml) runs the HF parity and
#   export/import tests in a fresh venv of its own;
# - transformers 4.x (which spells RoPE rope_theta, not rope_parameters) loads an export made with the pinned one
#   and gives the same rope_theta and logits (tests/test_export_hf_transformers4.py); it also loads the custom-code
#   folders of every architecture switch with equal logits and greedy generation (tests/test_export_custom_code.py).
# Each venv gets torch exactly as scripts/setup_venv.sh installs it. Run after scripts/setup_venv.sh (CI does).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
TRANSFORMERS4="${SCRATCHLM_TRANSFORMERS4:-transformers==4.57.1}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/scratchlm-transformers.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

FLOOR="$(sed -n 's/.*"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml | head -n 1)"
[ -n "$FLOOR" ] || { echo "test_transformers_versions: no transformers>= floor in pyproject.toml" >&2; exit 1; }

echo "test_transformers_versions: transformers==$FLOOR (the floor) runs the HF tests"
make_venv "$WORK/floor" -e ".[test]" "transformers==$FLOOR"
"$WORK/floor/bin/python" -c 'import transformers; print("  transformers", transformers.__version__)'
"$WORK/floor/bin/python" -m pytest -q -p no:cacheprovider tests/test_hf_parity.py tests/test_export_hf.py \
    tests/test_import_hf.py tests/test_export_custom_code.py

echo "test_transformers_versions: $TRANSFORMERS4 loads an export"
make_venv "$WORK/v4" "$TRANSFORMERS4"
SCRATCHLM_TRANSFORMERS4_PYTHON="$WORK/v4/bin/python" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_export_hf_transformers4.py \
    tests/test_export_custom_code.py::test_transformers_4_loads_the_folders_with_equal_logits_and_generation
