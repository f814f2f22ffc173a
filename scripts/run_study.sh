#!/usr/bin/env bash
# The CS336 experiments at CPU scale on the shared TinyStories data, written up under docs/study/:
#   1. a learning-rate sweep (1e-3 .. 1) in which the largest rates diverge,
#   2. a batch-size study at a fixed token budget (4, 16, 64 sequences a step),
#   3. the ablations in configs/ablations/ (no RMSNorm, post-norm, NoPE, SiLU FFN, tied embeddings),
# all from configs/study/base.toml (~0.6M tokens a run; 14 runs, roughly 30-40 minutes on 2 idle cores).
# The tokenizer and token files are made once. Rerunning continues: finished runs are kept and interrupted
# ones resume from their checkpoints.
#
#   bash scripts/run_study.sh           # the study; reports in docs/study/{lr,batch,ablations}/
#   bash scripts/run_study.sh --smoke   # every step of it with 4-step runs, in runs/study-smoke/ (a check)
# It runs scripts/setup_venv.sh first, so a clean checkout needs nothing else (but the TinyStories text).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_venv.sh  # ./.venv with scratchlm (a few seconds when it is already there)
# One PyTorch thread: as fast within ~1.5x on an idle 2-core machine, and several times faster than two when
# other processes compete for the cores (threads then wait on each other). Set OMP_NUM_THREADS to override.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CLI=.venv/bin/scratchlm
PY=.venv/bin/python
BASE=configs/study/base.toml
STUDY=runs/study
DOCS=docs/study
SHORT=()  # extra overrides, applied last
if [[ "${1:-}" == "--smoke" ]]; then
  STUDY=runs/study-smoke
  DOCS=$STUDY/reports
  SHORT=(--set train.max_steps=4 --set train.eval_every=2 --set train.eval_batches=2 --set optim.warmup_iters=1
         --set train.checkpoint_every=2 --set train.log_every=1)
fi
DATA=(--set "data.train_path=$STUDY/data/train.tok" --set "data.val_path=$STUDY/data/valid.tok"
      --set "data.tokenizer=$STUDY/tokenizer")
EOT='<|endoftext|>'

# 1. One tokenizer and one pair of token files for every run.
if [[ ! -f $STUDY/data/valid.tok ]]; then
  TS=$($PY -c 'from scratchlm.paths import shared_data_file as f; print(f("tinystories/TinyStories-train.txt") or "")')
  VS=$($PY -c 'from scratchlm.paths import shared_data_file as f; print(f("tinystories/TinyStories-valid.txt") or "")')
  if [[ -z $TS || -z $VS ]]; then
    echo "run_study.sh: TinyStories not found in the shared data folder; run: scratchlm data download tinystories" >&2
    exit 1
  fi
  mkdir -p "$STUDY/data"
  $CLI tokenizer train --input "$TS" --vocab-size 2048 --special-token "$EOT" --out "$STUDY/tokenizer"
  $CLI data encode --tokenizer "$STUDY/tokenizer" --input "$TS" --out "$STUDY/data/train.tok"
  $CLI data encode --tokenizer "$STUDY/tokenizer" --input "$VS" --out "$STUDY/data/valid.tok"
fi

STATUS='import sys; from scratchlm.experiments.runs import run_status; print(run_status(sys.argv[1]))'

# train NAME CONFIG [--set ...]: one run in $STUDY/NAME; kept when done, resumed when interrupted.
# A diverged run is a result, not a failure of the study.
train() {
  local dir=$STUDY/$1 config=$2
  shift 2
  local status
  status=$($PY -c "$STATUS" "$dir")
  if [[ $status == finished || $status == diverged ]]; then
    echo "== $dir: already $status"
    return
  fi
  echo "== $dir"
  local code=0
  $CLI train --config "$config" "${DATA[@]}" "$@" "${SHORT[@]}" --run-dir "$dir" --resume --quiet || code=$?
  if [[ $code != 0 && $($PY -c "$STATUS" "$dir") != diverged ]]; then
    exit "$code"
  fi
}

# ablation_overrides FILE: the [model] keys an ablation preset changes, as --set arguments (the preset files
# are the one definition of each ablation; the study applies their diff to its own smaller base).
ablation_overrides() {
  $PY - "$1" <<'EOF'
import sys, tomllib
for key, value in tomllib.load(open(sys.argv[1], "rb"))["model"].items():
    print("--set")
    print(f"model.{key}={str(value).lower() if isinstance(value, bool) else value}")
EOF
}

train baseline "$BASE"

# 2. Learning rates: the sweep skips finished points and resumes interrupted ones by itself. A train loss
# above 10 (untrained: ln 2048 = 7.6) counts as divergence here, so a too-high rate is flagged and stopped
# early. (Not in the base: the model without RMSNorm legitimately starts above 10.)
$CLI sweep --config "$BASE" "${DATA[@]}" --set train.max_loss=10 "${SHORT[@]}" \
  --grid optim.lr=1e-3,3e-3,1e-2,3e-2,1e-1,1 \
  --out "$STUDY/lr" --quiet

# 3. Batch size at a fixed budget of 4,800 sequences (~0.6M tokens): fewer, larger steps or more, smaller ones.
train batch-4 "$BASE" --set data.batch_size=4 --set train.max_steps=1200 --set train.eval_every=200
train batch-64 "$BASE" --set data.batch_size=64 --set train.max_steps=75 --set train.eval_every=15 \
  --set optim.warmup_iters=8

# 4. Ablations, each the baseline plus one preset's diff.
ABLATIONS=(no-rmsnorm post-norm nope silu-ffn tied-embeddings)
for name in "${ABLATIONS[@]}"; do
  # A plain assignment, so that set -e stops the study when the helper fails (the exit status of a process
  # substitution, `mapfile < <(...)`, is never checked: a failed ablation would silently train the baseline).
  out=$(ablation_overrides "configs/ablations/$name.toml")
  if [[ -z $out ]]; then
    echo "run_study.sh: configs/ablations/$name.toml changes no [model] key;" \
         "refusing to train a copy of the baseline" >&2
    exit 1
  fi
  mapfile -t overrides <<<"$out"
  train "ablation-$name" "$BASE" "${overrides[@]}"
done

# 5. Reports (self-contained HTML + Markdown) next to the docs.
$CLI report "$STUDY/lr" --out "$DOCS/lr" --title "Learning-rate sweep (TinyStories, CPU scale)"
$CLI report "$STUDY/batch-4" "$STUDY/baseline" "$STUDY/batch-64" --baseline "$STUDY/baseline" --out "$DOCS/batch" \
  --title "Batch size at a fixed token budget (TinyStories, CPU scale)"
$CLI report "$STUDY/baseline" "${ABLATIONS[@]/#/$STUDY/ablation-}" --out "$DOCS/ablations" \
  --title "Architecture ablations (TinyStories, CPU scale)"
echo "study reports: $DOCS/lr/report.html $DOCS/batch/report.html $DOCS/ablations/report.html"
