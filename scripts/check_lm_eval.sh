#!/usr/bin/env bash
# EleutherAI's lm-evaluation-harness scores an export, and a `scratchlm serve` of the run, exactly as
# `scratchlm eval --continuations` scores the run.
#
# In a fresh venv (torch first exactly as scripts/setup_venv.sh installs it: SCRATCHLM_TORCH,
# SCRATCHLM_TORCH_INDEX_URL; then the pinned lm-eval, SCRATCHLM_LM_EVAL, and this checkout with [hf,serve]): a
# tokenizer and a tiny run trained for a few dozen steps on a generated text, exported with `scratchlm export hf`
# (a LlamaForCausalLM); two local tasks over JSONL files, no Hub (a `loglikelihood` one whose contexts include an
# empty one, trailing spaces, a token across the boundary and one longer than the model's context; and a
# `multiple_choice` one); `lm_eval --model hf ... --log_samples` offline on the CPU. Then `scratchlm serve run` on
# a free loopback port and `lm_eval --model local-completions` against it (token-id prompts, batched and
# concurrent; the export's tokenizer.json as lm-eval's tokenizer) on the same tasks. For each of the two lm_eval
# runs, every request it logged, with the context and continuation strings it scored, goes through
# `scratchlm eval --continuations` on the run: each log-likelihood must equal lm_eval's within 1e-4 and each greedy
# flag must be the same.
# Everything happens in a temporary folder (removed at the end; KEEP=1 keeps it). Prints the seconds each stage took.
# SCRATCHLM_LM_EVAL_VENV=DIR uses the venv at DIR instead of one in the temporary folder (made there if missing,
# kept afterwards; the installs then take seconds): for iterating on this script, not for CI.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/venv.sh
REPO="$PWD"
LM_EVAL="${SCRATCHLM_LM_EVAL:-lm-eval[hf,api]==0.4.13}"  # [api]: local-completions (aiohttp, tenacity, ...)
WORK="$(mktemp -d "${TMPDIR:-/tmp}/scratchlm-lm-eval.XXXXXX")"
VENV="${SCRATCHLM_LM_EVAL_VENV:-$WORK/venv}"
SERVER=""  # the pid of `scratchlm serve` while it runs
cleanup() {
    [ -z "$SERVER" ] || { kill "$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; } || true
    [ -n "${KEEP:-}" ] || rm -rf "$WORK"
}
trap cleanup EXIT
SECONDS=0
stage() { echo "check_lm_eval: [${SECONDS}s] $*"; }
fail() { echo "check_lm_eval: FAILED: $*" >&2; exit 1; }

stage "installing torch, then $LM_EVAL and scratchlm[hf,serve] into $VENV"
make_venv "$VENV" "$LM_EVAL" -e "$REPO[hf,serve]"
SCRATCHLM="$VENV/bin/scratchlm"

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
"$VENV/bin/python" - <<'PY'
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

# lm_eval NAME MODEL MODEL_ARGS [OPTION...]: the two tasks, offline, --log_samples into $WORK/NAME.
run_lm_eval() {
    local name="$1" model="$2" model_args="$3"
    shift 3
    HF_HOME="$WORK/hf-home" HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
        "$VENV/bin/lm_eval" --model "$model" --model_args "$model_args" \
        --tasks scratchlm_continuations,scratchlm_choices --include_path "$WORK/tasks" "$@" \
        --log_samples --output_path "$WORK/$name" >"$name.log" 2>&1 || { tail -n 40 "$name.log" >&2; fail "$name"; }
}

# compare NAME [EVAL_OPTION...]: every request lm_eval logged in $WORK/NAME, scored by
# `scratchlm eval --continuations` on the run.
compare() {
    local name="$1"
    shift
    "$VENV/bin/python" - "$name" <<'PY' || fail "could not read lm_eval's samples in $name"
import glob
import json
import sys

name = sys.argv[1]
samples = sorted(glob.glob(f"{name}/**/samples_*.jsonl", recursive=True))
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
with open(f"{name}/pairs.jsonl", "w", encoding="utf-8") as handle:
    handle.writelines(json.dumps(pair) + "\n" for pair in pairs)
with open(f"{name}/expected.jsonl", "w", encoding="utf-8") as handle:
    handle.writelines(json.dumps(record) + "\n" for record in expected)
print(f"check_lm_eval: {name}: lm_eval logged {len(pairs)} requests in {len(samples)} tasks")
PY
    "$SCRATCHLM" eval --checkpoint run --continuations "$name/pairs.jsonl" --out "$name/scores.jsonl" --device cpu \
        "$@" >"$name/eval.txt" || { cat "$name/eval.txt" >&2; fail "scratchlm eval --continuations"; }
    "$VENV/bin/python" - "$name" <<'PY'
import json
import sys

def read(path):
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]

name = sys.argv[1]
pairs, expected, ours = read(f"{name}/pairs.jsonl"), read(f"{name}/expected.jsonl"), read(f"{name}/scores.jsonl")
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
    sys.exit(f"check_lm_eval: FAILED: {name}: {len(bad)} of {len(ours)} requests differ (log-likelihood within "
             f"1e-4 and the same greedy flag wanted):\n" + "\n".join(bad))
print(f"check_lm_eval: {name}: {len(ours)} log-likelihoods equal lm_eval's (largest difference {worst:.2e}), "
      f"greedy flags equal ({greedy} greedy)")
with open(f"{name}/passed", "w") as handle:
    handle.write(f"{len(ours)}\n")
PY
}

stage "lm_eval --model hf on the export, offline"
run_lm_eval lm-eval-hf hf "pretrained=$WORK/hf,dtype=float32" --device cpu --batch_size 4

stage "every request lm_eval --model hf logged, scored by scratchlm eval --continuations"
compare lm-eval-hf

stage "scratchlm serve on a free loopback port"
PORT="$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$SCRATCHLM" serve run --port "$PORT" --threads 1 --log-level warning >serve.log 2>&1 &
SERVER=$!
# the served model's id and context (GET /v1/models), once /health answers
"$VENV/bin/python" - "$PORT" "$SERVER" >served.txt <<'PY' || { cat serve.log >&2; fail "scratchlm serve"; }
import json
import os
import sys
import time
import urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
while True:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
            if json.load(response)["status"] == "ok":
                break
    except OSError:
        os.kill(pid, 0)  # the server is gone: ProcessLookupError
        if time.monotonic() > deadline:
            sys.exit("no answer on /health")
        time.sleep(0.2)
with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
    (model,) = json.load(response)["data"]
print(model["id"], model["context_length"])
PY
read -r MODEL_ID CONTEXT <served.txt

stage "lm_eval --model local-completions against the server (model $MODEL_ID, context $CONTEXT)"
# lm-eval keeps the last max_length - 1 tokens and asks for 1 more; the server needs no room for that one (only a
# sampled token it feeds back takes a place), so max_length = context + 1 fills the context. That window is still
# one token shorter than the hf model's (context + 1 kept, the last never read): on requests longer than the
# context, eval --window CONTEXT-1 scores what local-completions reads.
run_lm_eval lm-eval-serve local-completions "base_url=http://127.0.0.1:$PORT/v1/completions,model=$MODEL_ID,\
tokenizer_backend=huggingface,tokenizer=$WORK/hf,tokenized_requests=True,max_length=$((CONTEXT + 1)),\
num_concurrent=2,max_retries=1" --batch_size 4
kill "$SERVER" && wait "$SERVER" || true
SERVER=""

stage "every request lm_eval --model local-completions logged, scored by scratchlm eval --continuations"
compare lm-eval-serve --window $((CONTEXT - 1))
# the plain closing line CI counts tests by
echo "check_lm_eval: $(($(cat lm-eval-hf/passed) + $(cat lm-eval-serve/passed))) passed, 0 failed"
stage "OK"
