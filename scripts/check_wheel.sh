#!/usr/bin/env bash
# A plain `pip install scratchlm` works: build the wheel, install it with NO extras into a fresh virtualenv (no
# system site-packages), and run tokenizer train -> data encode -> train -> generate -> eval on a tiny text.
# Also checks that a missing extra is one line naming it (export hf without [hf]) and that training without
# matplotlib warns once and writes no curves.png. Then, with the [hf,tracking] extras: a folder of JSONL files ->
# tokenizer -> train/validation token files -> a run with TensorBoard, moved to another folder (its tokenizer
# deleted), generating and exporting from there, the export loaded by AutoModelForCausalLM / AutoTokenizer; and a
# custom-code export (compat/hf_custom_code.py) loaded with trust_remote_code, its logits equal ours.
#
# torch is installed first exactly as scripts/setup_venv.sh does it (SCRATCHLM_TORCH, SCRATCHLM_TORCH_INDEX_URL),
# so on this project's machines it is the local CPU wheel. Everything happens in a temporary folder (removed at
# the end; KEEP=1 keeps it). Prints the seconds each stage took.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/scratchlm-wheel.XXXXXX")"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
PIP=(--quiet --disable-pip-version-check)
SECONDS=0
stage() { echo "check_wheel: [${SECONDS}s] $*"; }
fail() { echo "check_wheel: FAILED: $*" >&2; exit 1; }

stage "building the wheel in $WORK"
"$PYTHON" -m venv "$WORK/build-venv"
"$WORK/build-venv/bin/python" -m pip install "${PIP[@]}" build
"$WORK/build-venv/bin/python" -m build --wheel --outdir "$WORK/dist" "$REPO" >"$WORK/build.log" 2>&1 \
    || { cat "$WORK/build.log" >&2; fail "python -m build"; }
WHEEL="$(ls "$WORK"/dist/scratchlm-*.whl)"

stage "installing torch, then $(basename "$WHEEL") with no extras"
make_venv "$WORK/venv" "$WHEEL"  # a plain venv sees no system site-packages
VENV_PY="$WORK/venv/bin/python"
for extra_only in matplotlib transformers tokenizers huggingface_hub tensorboard wandb psutil; do
    if "$VENV_PY" -c "import $extra_only" 2>/dev/null; then fail "$extra_only came with a plain install"; fi
done

stage "tokenizer train -> data encode -> train -> generate -> eval"
cd "$WORK"  # not the checkout: the installed package must not lean on the source tree
SCRATCHLM="$WORK/venv/bin/scratchlm"
for i in $(seq 1 400); do
    echo "Once upon a time, story $i: a small fox found $((i % 7)) red apples and shared them with a friend."
done >text.txt
"$SCRATCHLM" tokenizer train --input text.txt --vocab-size 300 --special-token '<|endoftext|>' --out tok --quiet
"$SCRATCHLM" data encode --tokenizer tok --input text.txt --out text.tok --quiet
cat >tiny.toml <<'TOML'
[model]
preset = "tiny"
vocab_size = 300

[optim]
warmup_iters = 2

[data]
batch_size = 4
tokenizer = "tok"

[train]
max_steps = 10
log_every = 5
eval_every = 5
eval_batches = 2
checkpoint_every = 10
run_dir = "run"
TOML
"$SCRATCHLM" train --config tiny.toml --set data.train_path=text.tok --set data.val_path=text.tok --quiet \
    2>train.err || { cat train.err >&2; fail "train"; }
[ "$(grep -c "matplotlib is not installed" train.err)" = 1 ] || { cat train.err >&2; fail "want ONE matplotlib warning"; }
[ ! -e run/curves.png ] || fail "curves.png written without matplotlib"
"$SCRATCHLM" generate --checkpoint run --prompt "Once upon" --max-new-tokens 8 --seed 0 >generated.txt
[ -s generated.txt ] || fail "generate printed nothing"
"$SCRATCHLM" eval --checkpoint run --data text.tok --batches 2 | tee eval.txt
grep -q "bits/byte" eval.txt || fail "eval reported no bits per byte"

stage "a missing extra is one line"
if "$SCRATCHLM" export hf --checkpoint run --out hf 2>export.err; then fail "export hf ran without [hf]"; fi
[ "$(wc -l <export.err)" = 1 ] && grep -q "pip install 'scratchlm\[hf\]'" export.err \
    || { cat export.err >&2; fail "export hf without [hf]: want one line naming the extra"; }
cat export.err

stage "with [hf,tracking]: a folder of JSONL -> a trained run, moved, generating, exported, loaded by transformers"
"$VENV_PY" -m pip install "${PIP[@]}" "$WHEEL[hf,tracking]"
mkdir docs
for part in 1 2 3; do
    for i in $(seq 1 150); do
        echo "{\"id\": $i, \"text\": \"Story $part.$i: the small fox found $((i % 7)) red apples.\\nThen it slept.\"}"
    done >"docs/part-$part.jsonl"
done
"$SCRATCHLM" tokenizer train --input docs --text-field text --vocab-size 300 --special-token '<|endoftext|>' \
    --out tok2 --quiet
"$SCRATCHLM" data encode --tokenizer tok2 --input docs --text-field text --val-fraction 0.1 --out docs.tok --quiet
"$SCRATCHLM" train --config tiny.toml --set data.tokenizer=tok2 --set data.train_path=docs.tok \
    --set data.val_path=docs.val.tok --set train.run_dir=run2 --set train.tensorboard=true --quiet 2>/dev/null
mkdir elsewhere && mv run2 elsewhere/run2 && rm -rf tok2  # the run carries its tokenizer and relative paths
"$SCRATCHLM" generate --checkpoint elsewhere/run2 --prompt "Story" --max-new-tokens 8 --seed 0 >generated2.txt
[ -s generated2.txt ] || fail "generate from a moved run printed nothing"
"$SCRATCHLM" export hf --checkpoint elsewhere/run2 --out hf2
"$VENV_PY" - <<'PY' || fail "transformers could not load the export, or TensorBoard has no loss"
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM, AutoTokenizer

from scratchlm.tokenizer import Tokenizer

model = AutoModelForCausalLM.from_pretrained("hf2").eval()
hf_ids = AutoTokenizer.from_pretrained("hf2")("Story 1.2: the small fox")["input_ids"]
ours = Tokenizer.load("elsewhere/run2/tokenizer").encode("Story 1.2: the small fox")
assert hf_ids == ours, (hf_ids, ours)
with torch.no_grad():
    assert torch.isfinite(model(torch.tensor([ours])).logits).all()
events = EventAccumulator("elsewhere/run2/tensorboard")
events.Reload()
assert any("loss" in tag for tag in events.Tags()["scalars"]), events.Tags()
print("check_wheel: transformers loads the export (ids equal ours); TensorBoard holds", events.Tags()["scalars"])
PY
stage "the wheel's custom-code export (its modeling files are package data) loads in transformers"
"$VENV_PY" - <<'PY' || fail "transformers could not load the custom-code export, or its logits differ"
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from scratchlm.compat.hf_custom_code import export_custom_code
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer

tokenizer = Tokenizer.load("elsewhere/run2/tokenizer")
cfg = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, ffn="relu2", qk_norm=True, logit_softcap=15.0)
model = TransformerLM(cfg).eval()
export_custom_code(model, tokenizer, Path("hf_custom"))
loaded = AutoModelForCausalLM.from_pretrained("hf_custom", trust_remote_code=True).eval()
ids = torch.tensor([tokenizer.encode("Story 1.2: the small fox")])
with torch.no_grad():
    torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=1e-5, atol=1e-5)
print("check_wheel: transformers loads the custom-code export (ReLU², QK-norm, soft cap) with equal logits")
PY
stage "OK"
