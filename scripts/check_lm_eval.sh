#!/usr/bin/env bash
# EleutherAI's lm-evaluation-harness scores an export exactly as `scratchlm eval --continuations` scores the run.
#
# In a fresh venv (torch first exactly as scripts/setup_venv.sh installs it: SCRATCHLM_TORCH,
# SCRATCHLM_TORCH_INDEX_URL; then the pinned lm-eval, SCRATCHLM_LM_EVAL, and this checkout with [hf]): a tokenizer
# and a tiny run trained for a few dozen steps on a generated text, exported with `scratchlm export hf` (a
# LlamaForCausalLM); two local tasks over JSONL files, no Hub (a `loglikelihood` one whose contexts include an
# empty one, trailing spaces, a token across the boundary and one longer than the model's context; and a
# `multiple_choice` one); `lm_eval --model hf ... --log_samples` offline on the CPU. Then every request lm_eval
# logged, with the context and continuation strings it scored, goes through `scratchlm eval --continuations` on
# the run: each log-likelihood must equal lm_eval's within 1e-4 and each greedy flag must be the same.
# Everything happens in a temporary folder (removed at the end; KEEP=1 keeps it). Prints the seconds each stage took.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PYTHON="${PYTHON:-python3}"
LM_EVAL="${SCRATCHLM_LM_EVAL:-lm-eval[hf]==0.4.13}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/scratchlm-lm-eval.XXXXXX")"
[ -n "${KEEP:-}" ] || trap 'rm -rf "$WORK"' EXIT
PIP=(--quiet --disable-pip-version-check)
SECONDS=0
stage() { echo "check_lm_eval: [${SECONDS}s] $*"; }
fail() { echo "check_lm_eval: FAILED: $*" >&2; exit 1; }

stage "installing torch, then $LM_EVAL and scratchlm[hf] into $WORK/venv"
"$PYTHON" -m venv "$WORK/venv"
TORCH_INDEX=()
[ -z "${SCRATCHLM_TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$SCRATCHLM_TORCH_INDEX_URL")
"$WORK/venv/bin/python" -m pip install "${PIP[@]}" "${TORCH_INDEX[@]}" "${SCRATCHLM_TORCH:-torch==2.13.0}"
"$WORK/venv/bin/python" -m pip install "${PIP[@]}" "$LM_EVAL" -e "$REPO[hf]"
SCRATCHLM="$WORK/venv/bin/scratchlm"

stage "a tokenizer and a tiny run, exported as a Hugging Face Llama"
cd "$WORK"
for i in $(seq 1 300); do
    echo "Once upon a time, a little fox named Tom found $((i % 5)) red apples. Tom said, “I like apples!”"
    echo "The sun was warm and the sky was blue. Tom shared the apples with his friend Sue.<|endoftext|>"
done >text.txt
"$SCRATCHLM" tokenizer train --input text.txt --vocab-size 320 --special-token '<|endoftext|>' --out tok --quiet
"$SCRATCHLM" data encode --tokenizer tok --input text.txt --out text.tok --quiet
cat >tiny.toml <<'TOML'
[model]
preset = "tiny"  # rmsnorm, RoPE, SwiGLU, no qk_norm or softcap: a standard Llama

[optim]
lr = 1e-2
warmup_iters = 4

[data]
batch_size = 8
tokenizer = "tok"

[train]
max_steps = 60
device = "cpu"
log_every = 60
eval_every = 60
eval_batches = 1
checkpoint_every = 60
run_dir = "run"
TOML
"$SCRATCHLM" train --config tiny.toml --set model.vocab_size=320 --set data.train_path=text.tok \
    --set data.val_path=text.tok --quiet 2>train.err || { cat train.err >&2; fail "train"; }
"$SCRATCHLM" export hf --checkpoint run --out hf >/dev/null

stage "two local tasks over JSONL files"
mkdir tasks
"$WORK/venv/bin/python" - <<'PY'
import json

context = 32  # the tiny preset's context_length
requests = [
    ("Once upon a time, a little", " fox"),  # likely the greedy continuation after training
    ("Once upon a time, a little ", "fox named Tom"),  # the trailing space moves to the continuation
    ("The sun was warm and the sky was", " blue."),
    ("The sun was warm and the sky was", " green."),
    ("Tom shared the appl", "es with his friend"),  # a token across the boundary
    ("", "Once upon a time"),  # no context: scored after <|endoftext|>
    ("", "<|endoftext|>Once upon"),  # ... which a continuation may bring itself
    ("Tom said, “I like", " apples!”"),
    (" ".join(["Tom found 3 red apples."] * 12), " The sun was warm"),  # longer than the context: cut on the left
    ("zebra quantum", " é 😀 ünïcödé"),
]
with open("tasks/requests.jsonl", "w", encoding="utf-8") as handle:
    for text, continuation in requests:
        handle.write(json.dumps({"context": text, "continuation": continuation}) + "\n")
questions = [
    ("Tom found some red", ["apples.", "cars.", "dogs."], 0),
    ("The sky was", ["blue.", "loud.", "Tom."], 0),
    ("Tom shared the apples with his friend", ["Sue.", "Ben.", "the sun."], 0),
]
with open("tasks/choices.jsonl", "w", encoding="utf-8") as handle:
    for question, choices, answer in questions:
        handle.write(json.dumps({"question": question, "choices": choices, "answer": answer}) + "\n")
PY
cat >tasks/scratchlm_continuations.yaml <<YAML
task: scratchlm_continuations
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/tasks/requests.jsonl
test_split: test
output_type: loglikelihood
doc_to_text: "{{context}}"
doc_to_target: "{{continuation}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
YAML
cat >tasks/scratchlm_choices.yaml <<YAML
task: scratchlm_choices
dataset_path: json
dataset_kwargs:
  data_files:
    test: $WORK/tasks/choices.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
YAML

stage "lm_eval --model hf on the export, offline"
HF_HOME="$WORK/hf-home" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
    "$WORK/venv/bin/lm_eval" --model hf --model_args "pretrained=$WORK/hf,dtype=float32" \
    --tasks scratchlm_continuations,scratchlm_choices --include_path "$WORK/tasks" --device cpu --batch_size 4 \
    --log_samples --output_path "$WORK/lm-eval-out" >lm_eval.log 2>&1 || { tail -n 40 lm_eval.log >&2; fail "lm_eval"; }

stage "every request lm_eval logged, scored by scratchlm eval --continuations"
"$WORK/venv/bin/python" - <<'PY' || fail "could not read lm_eval's samples"
import glob
import json

samples = sorted(glob.glob("lm-eval-out/**/samples_*.jsonl", recursive=True))
assert len(samples) == 2, f"want the samples of 2 tasks, found {samples}"
pairs, expected, paths = [], [], []  # paths: the samples file of each request
for path in samples:
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            sample = json.loads(line)
            arguments = sorted(sample["arguments"].items(), key=lambda item: int(item[0].rsplit("_", 1)[1]))
            assert len(arguments) == len(sample["resps"]), path
            for (_, argument), response in zip(arguments, sample["resps"]):
                loglikelihood, is_greedy = response[0]
                pairs.append({"context": argument["arg_0"], "continuation": argument["arg_1"]})
                paths.append(path)
                expected.append({"loglikelihood": float(loglikelihood), "is_greedy": str(is_greedy) == "True"})
with open("tasks/requests.jsonl", encoding="utf-8") as handle:
    asked = [json.loads(line) for line in handle]
logged = [pair for pair, path in zip(pairs, paths) if "scratchlm_continuations" in path]
assert sorted(logged, key=json.dumps) == sorted(asked, key=json.dumps), \
    f"lm_eval scored other strings than the task's:\n{logged}\n{asked}"
with open("pairs.jsonl", "w", encoding="utf-8") as handle:
    handle.writelines(json.dumps(pair) + "\n" for pair in pairs)
with open("expected.jsonl", "w", encoding="utf-8") as handle:
    handle.writelines(json.dumps(record) + "\n" for record in expected)
print(f"check_lm_eval: lm_eval logged {len(pairs)} requests in {len(samples)} tasks")
PY
"$SCRATCHLM" eval --checkpoint run --continuations pairs.jsonl --out scores.jsonl --device cpu >eval.txt \
    || { cat eval.txt >&2; fail "scratchlm eval --continuations"; }
"$WORK/venv/bin/python" - <<'PY'
import json
import sys

def read(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]

pairs, expected, ours = read("pairs.jsonl"), read("expected.jsonl"), read("scores.jsonl")
assert len(ours) == len(expected), (len(ours), len(expected))
bad = []
for pair, theirs, mine in zip(pairs, expected, ours):
    difference = abs(theirs["loglikelihood"] - mine["loglikelihood"])
    if difference > 1e-4 or theirs["is_greedy"] != mine["is_greedy"]:
        bad.append(f"  {pair}: lm_eval {theirs['loglikelihood']:.6f} greedy={theirs['is_greedy']}, "
                   f"scratchlm {mine['loglikelihood']:.6f} greedy={mine['is_greedy']}")
worst = max(abs(t["loglikelihood"] - m["loglikelihood"]) for t, m in zip(expected, ours))
greedy = sum(record["is_greedy"] for record in ours)
if bad:
    sys.exit(f"check_lm_eval: FAILED: {len(bad)} of {len(ours)} requests differ (log-likelihood within 1e-4 "
             f"and the same greedy flag wanted):\n" + "\n".join(bad))
print(f"check_lm_eval: {len(ours)} log-likelihoods equal lm_eval's (largest difference {worst:.2e}), "
      f"greedy flags equal ({greedy} greedy)")
print(f"check_lm_eval: {len(ours)} passed, 0 failed")  # the plain closing line CI counts tests by
PY
stage "OK"
