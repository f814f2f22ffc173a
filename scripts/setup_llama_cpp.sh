#!/usr/bin/env bash
# Build llama.cpp, as llama-cpp-python vendors it, into a virtual environment of its own: the real client that
# tests/test_gguf_llama_cpp.py and benchmarks/bench_llama_cpp.py run our GGUF exports through.
#
# llama-cpp-python is compiled from its source distribution (gcc/g++ and cmake must be on PATH; pip fetches the
# build's Python requirements). That takes minutes (about 6.5 on 2 cores), so the venv lives in a cache folder
# outside the clone and the build is skipped when that venv already imports llama_cpp at the pinned version:
#   SCRATCHLM_LLAMA_CPP_VENV   the venv (default ${XDG_CACHE_HOME:-$HOME/.cache}/scratchlm/llama-cpp-VERSION)
#   SCRATCHLM_LLAMA_CPP        the requirement (default llama-cpp-python==0.3.36)
#   CMAKE_ARGS                 passed to llama.cpp's cmake as llama-cpp-python documents (e.g. -DGGML_NATIVE=OFF)
# The venv holds no torch and no scratchlm: the tests talk to it through a driver script, JSON on stdout.
# Prints the venv's python on its last line.
set -euo pipefail
REQUIREMENT="${SCRATCHLM_LLAMA_CPP:-llama-cpp-python==0.3.36}"
VERSION="${REQUIREMENT##*==}"
VENV="${SCRATCHLM_LLAMA_CPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/scratchlm/llama-cpp-$VERSION}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, sys
sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
    echo "setup_llama_cpp: $REQUIREMENT already built in $VENV" >&2
    echo "$VENV/bin/python"
    exit 0
fi
for tool in cmake gcc g++; do
    command -v "$tool" >/dev/null || { echo "setup_llama_cpp: $tool is not on PATH (needed to build $REQUIREMENT)" >&2; exit 1; }
done
SECONDS=0
echo "setup_llama_cpp: building $REQUIREMENT from source into $VENV (minutes)" >&2
mkdir -p "$(dirname "$VENV")"
"${PYTHON:-python3}" -m venv "$VENV"
# Quiet unless it fails: the compiler's output is long; keep it in a log beside the venv.
LOG="$VENV/build.log"
if ! CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
        "$VENV/bin/python" -m pip install --disable-pip-version-check --no-binary llama-cpp-python \
        "$REQUIREMENT" >"$LOG" 2>&1; then
    tail -n 30 "$LOG" >&2
    echo "setup_llama_cpp: the build of $REQUIREMENT failed (log: $LOG); removing the half-made venv" >&2
    mv "$LOG" "${VENV%/}.build.log"
    rm -rf "$VENV"
    exit 1
fi
"$VENV/bin/python" -c "import llama_cpp; print('setup_llama_cpp: llama_cpp', llama_cpp.__version__)" >&2
echo "setup_llama_cpp: built in ${SECONDS}s" >&2
echo "$VENV/bin/python"
