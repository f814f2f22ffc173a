# Sourced, not run: the one way scripts/ make a virtualenv, so that every venv gets the same torch.
# Callers cd to the checkout's root first and `source scripts/lib/venv.sh` from there.
#
# make_venv DIR REQUIREMENT...: a venv at DIR (made with $PYTHON, default python3, unless DIR already holds one),
# torch installed into it FIRST as `pip install ${SCRATCHLM_TORCH:-torch==2.13.0}` (with --index-url
# $SCRATCHLM_TORCH_INDEX_URL when that is set; scripts/setup_venv.sh says why and which build that gives), then
# the requirements (pip arguments: names, a wheel's path, -e DIR[extras]), which then find torch satisfied.
make_venv() {
    local venv="$1" index=()
    shift
    [ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
    [ -z "${SCRATCHLM_TORCH_INDEX_URL:-}" ] || index=(--index-url "$SCRATCHLM_TORCH_INDEX_URL")
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${index[@]}" \
        "${SCRATCHLM_TORCH:-torch==2.13.0}"
    "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$@"
}
