"""Bad input at every stage: one line naming the problem, a non-zero exit, and nothing lost.

Each case runs the real CLI in a copy of one small world (two tokenizers of the same size, token files, a
trained tiny run, a Hugging Face export, a half-run sweep) and checks that every file that was there before is
byte-identical afterwards, and that no new file or folder (empty or not) remains: a refused command leaves
nothing behind. ``{T}`` in an argument stands for the world's folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.data.token_file import TokenFileWriter
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.train.run_lock import RunLock

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "configs" / "tiny.toml"
TINY_RUN = ["--set", "train.max_steps=6", "--set", "train.checkpoint_every=6", "--set", "train.eval_every=6",
            "--set", "train.eval_batches=1", "--set", "data.batch_size=4", "--quiet"]
HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None
needs_pyarrow = pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow is not installed")


def byte_tokenizer(shift: int) -> Tokenizer:
    """256 single-byte tokens, ids rotated by ``shift``: same size as any other shift, a different hash."""
    return Tokenizer({(byte + shift) % 256: bytes([byte]) for byte in range(256)}, [], [])


def write_tokens(path: Path, tokenizer: Tokenizer, text: str) -> None:
    with TokenFileWriter(path, vocab_size=256, tokenizer_hash=tokenizer.hash) as writer:
        writer.write(np.array(tokenizer.encode(text)))


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("world")
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "away", "home"]
    text = " ".join(rng.choice(words, size=6000)) + "\n"
    (root / "corpus.txt").write_text(text)
    (root / "notes.txt").write_text("a file of the user's\n")
    (root / "link.txt").symlink_to(root / "corpus.txt")
    (root / "docs").mkdir()  # documents for the readers both `data encode` and `tokenizer train` use
    (root / "docs" / "a.jsonl").write_text('{"text": "the cat sat"}\n{"text": "on a mat"}\n')
    if HAS_PYARROW:
        from pyarrow import parquet, table

        parquet.write_table(table({"text": ["the cat", "sat"]}), root / "docs" / "b.parquet")
    (root / "bad_utf8.jsonl").write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "caf\xe9"}\n')
    (root / "no_continuation.jsonl").write_text('{"context": "the", "continuation": " cat"}\n{"context": "a"}\n')
    (root / "continuations.jsonl").write_text('{"context": "the", "continuation": " cat"}\n')
    (root / "not_json.jsonl").write_text('{"context": "the", "continuation": " cat"}\nthe cat\n')
    (root / "number_continuation.jsonl").write_text('{"context": "the", "continuation": 5}\n')
    chat = '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]}\n'
    (root / "chat.jsonl").write_text(chat)
    (root / "chat_bad_role.jsonl").write_text(chat + chat.replace('"assistant"', '"bot"'))
    (root / "chat_not_json.jsonl").write_text(chat + "the cat\n")
    (root / "completion_list.jsonl").write_text('{"prompt": "the", "completion": ["cat"]}\n')
    (root / "completions.jsonl").write_text('{"prompt": "the", "completion": " cat"}\n')
    (root / "chat_completion_str.jsonl").write_text('{"prompt": [{"role": "user", "content": "hi"}], '
                                                    '"completion": "x"}\n')
    token_a, token_b = byte_tokenizer(0), byte_tokenizer(1)
    token_a.save(root / "tokA")
    token_b.save(root / "tokB")
    for name, tokenizer in (("train", token_a), ("val", token_a), ("train_b", token_b), ("val_b", token_b)):
        write_tokens(root / f"{name}.tok", tokenizer, text)
    shutil.copy(TINY, root / "tiny.toml")
    data = ["--set", f"data.train_path={root}/train.tok", "--set", f"data.val_path={root}/val.tok"]
    assert main(["train", "--config", str(TINY), *TINY_RUN, *data, "--set", f"data.tokenizer={root}/tokA",
                 "--run-dir", str(root / "run")]) == 0
    assert main(["export", "hf", "--checkpoint", str(root / "run"), "--out", str(root / "hf")]) == 0
    # llama.cpp's tokenizer needs a merge (tokA has none): a run of a tokenizer with one, and its GGUF export.
    with_merge = Tokenizer({byte: bytes([byte]) for byte in range(256)} | {256: b"th"}, [(b"t", b"h")], [])
    write_run(TransformerLM(ModelConfig.preset("tiny", vocab_size=257)), with_merge, root / "gguf_run")
    assert main(["export", "gguf", "--checkpoint", str(root / "gguf_run"), "--out", str(root / "run.gguf")]) == 0
    relu2 = TransformerLM(ModelConfig.preset("tiny", ffn="relu2"))  # llama.cpp has no ReLU² FFN
    write_run(relu2, token_a, root / "relu2_run")
    (root / "export").mkdir()
    (root / "export" / "config.json").write_text('{"the user": "config"}')
    (root / "user").mkdir()
    (root / "user" / "config.toml").write_text(f"# my settings\nextends = '{TINY}'\n")
    assert main(["sweep", "--config", str(TINY), "--grid", "optim.lr=1e-3,2e-3", "--shard", "0/2", *TINY_RUN,
                 "--out", str(root / "sweep"), *data]) == 0
    return root


def snapshot(root: Path) -> dict[str, str]:
    """Every file (sha256), symlink (target) and folder ('dir') under root."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[key] = "dir"
            else:
                found[key] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def check_refused(world: Path, tmp_path: Path, capsys, argv: list[str], message: str, *, hold_lock: str | None = None):
    """Run ``argv`` in a copy of the world and check the one-line refusal and that nothing changed."""
    root = tmp_path / "w"
    shutil.copytree(world, root, symlinks=True)
    (root / "link.txt").unlink()
    (root / "link.txt").symlink_to(root / "corpus.txt")
    lock = None
    if hold_lock is not None:
        (root / hold_lock).mkdir(parents=True, exist_ok=True)
        lock = RunLock(root / hold_lock).acquire()
    before = snapshot(root)
    capsys.readouterr()
    try:
        code = main([arg.replace("{T}", str(root)) for arg in argv])
    finally:
        if lock is not None:
            lock.release()
    error = capsys.readouterr().err.replace(str(root), "{T}")
    assert code != 0
    assert error.count("\n") == 1 and "error:" in error, error
    assert message in error, error
    after = snapshot(root)
    if hold_lock is not None:
        before.pop(f"{hold_lock}/{'.lock'}")
    assert after == before  # same files, same bytes, no new file or folder
    return error


@pytest.mark.parametrize("argv, message", [
    (["--input", "{T}/corpus.txt", "--out", "{T}/corpus.txt"], "--out {T}/corpus.txt is the input {T}/corpus.txt"),
    (["--input", "{T}/corpus.txt", "--out", "{T}/link.txt"], "is the input {T}/corpus.txt"),  # a symlink to it
    (["--input", "{T}/corpus.txt", "--out", "{T}/link.txt", "--force"], "is the input"),
    (["--input", "{T}/corpus.txt", "--out", "{T}/tokA/vocab.json", "--force"], "is the input {T}/tokA/vocab.json"),
    (["--input", "{T}/corpus.txt", "--out", "{T}/notes.txt"], "--out {T}/notes.txt exists and is not a token file"),
    (["--input", "{T}/missing.txt", "--out", "{T}/new.tok"], "missing.txt does not exist"),
    (["--input", "{T}/docs/a.jsonl", "--text-field", "body", "--out", "{T}/new.tok", "--no-eot"],
     "{T}/docs/a.jsonl:1: no field 'body' (fields: 'text')"),
])
def test_data_encode(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["data", "encode", "--tokenizer", "{T}/tokA", "--quiet", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--input", "{T}/corpus.txt", "--out", "{T}/tokA"], "--out {T}/tokA already holds files"),  # runs use it
    (["--input", "{T}/corpus.txt", "--out", "{T}/corpus.txt"], "--out {T}/corpus.txt is a file"),
    (["--input", "{T}/corpus.txt", "--out", "{T}", "--force"], "--out {T} holds the input {T}/corpus.txt"),
    (["--input", "{T}/tokA/vocab.json", "--out", "{T}/tokA", "--force"], "holds the input {T}/tokA/vocab.json"),
    (["--input", "{T}/corpus.txt", "--out", "{T}/new/tok", "--vocab-size", "10"], "vocab"),
    (["--input", "{T}/docs/a.jsonl", "--text-field", "body", "--out", "{T}/new/tok"],
     "{T}/docs/a.jsonl:1: no field 'body' (fields: 'text'); choose one with --text-field"),
    (["--input", "{T}/bad_utf8.jsonl", "--out", "{T}/new/tok"], "{T}/bad_utf8.jsonl:3: invalid UTF-8 at column 14"),
    pytest.param(["--input", "{T}/docs/b.parquet", "--text-field", "body", "--out", "{T}/new/tok"],
                 "{T}/docs/b.parquet: no column 'body' (columns: 'text')", marks=needs_pyarrow),
    (["--input", "{T}/docs", "--out", "{T}/docs/tok"], "--out {T}/docs/tok lies inside the input {T}/docs"),
    (["--input", "{T}/*.missing", "--out", "{T}/new/tok"], "input pattern {T}/*.missing matches no files"),
    (["--input", "{T}/missing.txt", "--out", "{T}/new/tok"], "input file {T}/missing.txt does not exist"),
    (["--input", "{T}/corpus.txt", "--out", "{T}/new/tok", "--pattern", "(?P<x"],
     "--pattern: split pattern '(?P<x' is not a valid regex"),
])
def test_tokenizer_train(world, tmp_path, capsys, argv, message):
    vocab = [] if "--vocab-size" in argv else ["--vocab-size", "270"]
    check_refused(world, tmp_path, capsys, ["tokenizer", "train", "--quiet", *vocab, *argv], message)


DATA = ["--set", "data.train_path={T}/train.tok", "--set", "data.val_path={T}/val.tok"]


@pytest.mark.parametrize("argv, message, hold_lock", [
    ([*DATA, "--run-dir", "{T}/run"], "run directory {T}/run already holds checkpoints", None),
    (["--run-dir", "{T}/run", "--resume"], "run directory {T}/run is in use by pid", "run"),
    (["--config", "{T}/user/config.toml", "--run-dir", "{T}/user", *DATA],
     "--config {T}/user/config.toml is the run directory's config.toml", None),
    (["--set", "data.train_path={T}/train.tok", "--set", "data.val_path={T}/val_b.tok", "--run-dir", "{T}/new/run"],
     "data.val_path {T}/val_b.tok with tokenizer", None),  # no data.tokenizer: the headers still must agree
    (["--run-dir", "{T}/run", "--resume", "--set", "data.tokenizer={T}/tokB", "--set",
      "data.train_path={T}/train_b.tok", "--set", "data.val_path={T}/val_b.tok"],
     "but this run was trained with tokenizer", None),  # a retrained tokenizer, its token files re-encoded
    (["--set", "data.train_path={T}/missing.tok", "--run-dir", "{T}/new/run"], "missing.tok does not exist", None),
    (["--set", "data.train_path={T}/corpus.txt", "--run-dir", "{T}/run2"], "is not a scratchlm token file", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--budget", "25 minutes"], "budget '25 minutes' is not a positive duration",
     None),
    ([*DATA, "--run-dir", "{T}/new/run", "--budget", "0.001s"], "budget 0.001 s is too small: a step takes", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--set", "optim.optimizer=muon", "--set", "optim.muon_params=^layers"],
     "selects layers.0.ln1.weight of shape (64,): Muon takes 2-D matrices only", None),
    (["--run-dir", "{T}/run", "--resume", "--budget", "5m"],
     "cannot resume {T}/run: it was planned without a budget, this asks for 300.0 s", None),
    (["--run-dir", "{T}/run", "--resume", "--set", "optim.lr=5e-3"],
     "the optimizer settings changed (saved -> asked: optim.lr 0.003 -> 0.005)", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--set", "data.tokenizer={T}/tokA", "--set", "model.vocab_size=200"],
     "model.vocab_size 200 is smaller than the 256 ids of tokenizer {T}/tokA: set it to at least 256", None),
    (["--run-dir", "{T}/run", "--resume", "--set", "data.train_path={T}/moved/train.tok"],  # a run moved alone
     "data.train_path: token file {T}/moved/train.tok does not exist (to train on, a moved or copied run needs "
     "--set data.train_path=FILE)", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/missing"], "train.init_from {T}/missing does not exist",
     None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/notes.txt"], "train.init_from {T}/notes.txt is a file",
     None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/docs"], "is a folder with neither checkpoints/", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/export"], "{T}/export/config.json: model_type", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/run", "--set", "model.d_model=32"],
     "model.d_model = 32 conflicts with the model of train.init_from {T}/run (d_model = 64)", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--init-from", "{T}/hf", "--set", "data.tokenizer={T}/tokB"],
     "data.tokenizer {T}/tokB is tokenizer", None),  # the exported folder's tokenizer.json is tokA
    ([*DATA, "--run-dir", "{T}/new/run", "--set", "model.num_layers=1000000"],  # ~2 TB: refused before allocating
     "the model needs ~1841.2 GB to train (params 164.4 GB, grads 164.4 GB, optimizer 328.7 GB, activations", None),
    ([*DATA, "--run-dir", "{T}/new/run", "--set", "data.format=conversations"],  # a fine-tuning config
     "data.format = conversations is trained by `scratchlm finetune`", None),
])
def test_train(world, tmp_path, capsys, argv, message, hold_lock):
    config = [] if "--config" in argv or "--resume" in argv else ["--config", str(TINY)]
    check_refused(world, tmp_path, capsys, ["train", *config, "--quiet", *argv], message, hold_lock=hold_lock)


@pytest.mark.parametrize("argv, message", [
    (["--data", "{T}/chat_bad_role.jsonl"], "{T}/chat_bad_role.jsonl:2: messages[1].role: unknown role 'bot'"),
    (["--data", "{T}/completion_list.jsonl"], "{T}/completion_list.jsonl:1: completion: expected a string, got list"),
    (["--data", "{T}/chat_completion_str.jsonl"],
     "{T}/chat_completion_str.jsonl:1: completion: expected a list of messages, as the prompt is one, got str"),
    (["--data", "{T}/chat_not_json.jsonl"], "{T}/chat_not_json.jsonl:2: malformed JSON (Expecting value, column 1)"),
    (["--data", "{T}/chat.jsonl", "--val-data", "{T}/chat_bad_role.jsonl"], "chat_bad_role.jsonl:2: messages[1]."),
    (["--data", "{T}/train.tok"], "{T}/train.tok: fine-tuning reads JSON lines (.jsonl)"),
    (["--data", "{T}/missing.jsonl"], "{T}/missing.jsonl does not exist"),
    ([], "--data is required"),
    (["--data", "{T}/chat.jsonl", "--init-from", "{T}/missing"], "train.init_from {T}/missing does not exist"),
    # refused once the tokenizer is known (the run's tokA has no end-of-text token): still nothing written
    (["--data", "{T}/completions.jsonl"], "a prompt-completion record needs an end-of-text token"),
    (["--data", "{T}/chat.jsonl", "--val-fraction", "0.9"], "data.val_fraction 0.9 of 1 records holds out 1"),
])
def test_finetune(world, tmp_path, capsys, argv, message):
    init = [] if "--init-from" in argv else ["--init-from", "{T}/run"]
    check_refused(world, tmp_path, capsys, ["finetune", *init, "--run-dir", "{T}/new/ft", "--device", "cpu", "--quiet",
                                            *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--from", "hh-rlhf", "{T}/chat.jsonl", "--out", "{T}/chat.jsonl"], "--out {T}/chat.jsonl is the input"),
    (["--from", "tinystories", "{T}/corpus.txt", "--out", "{T}/notes.txt"], "--out {T}/notes.txt exists"),
    (["--from", "hh-rlhf", "{T}/corpus.txt", "--out", "{T}/new.jsonl"], "{T}/corpus.txt:1: expected a JSON object"),
])
def test_data_conversations(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["data", "conversations", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint", "{T}/run", "--tokenizer", "{T}/tokB"], "tokenizer {T}/tokB has hash"),
    (["--checkpoint", "{T}/run", "--tokenizer", "{T}/missing"], "tokenizer directory {T}/missing not found"),
    (["--checkpoint", "{T}/corpus.txt"], "{T}/corpus.txt is neither a checkpoint directory"),
    (["--checkpoint", "{T}/run", "--num-samples", "0"], "--num-samples must be at least 1"),
    (["--checkpoint", "{T}/run", "--max-new-tokens", "1000"], "max_tokens is 1000, more than the model's context of"),
])
def test_generate(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["generate", "--prompt", "the cat", "--max-new-tokens", "3", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["{T}/run"], "this model's tokenizer has no chat template (a base model)"),
    (["{T}/run", "--tokenizer", "{T}/tokB"], "tokenizer {T}/tokB has hash"),
    (["{T}/corpus.txt"], "{T}/corpus.txt is neither a checkpoint directory"),
])
def test_chat(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["chat", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--data", "{T}/val_b.tok"], "{T}/val_b.tok was encoded with tokenizer"),
    (["--data", "{T}/corpus.txt"], "{T}/corpus.txt is not a scratchlm token file"),
    (["--data", "{T}/val.tok", "--batch-size", "0"], "--batch-size and --batches must be positive"),
    (["--continuations", "{T}/no_continuation.jsonl"], "{T}/no_continuation.jsonl:2: field 'continuation' is missing"),
    (["--continuations", "{T}/not_json.jsonl"], "{T}/not_json.jsonl:2: malformed JSON (Expecting value, column 1)"),
    (["--continuations", "{T}/number_continuation.jsonl"],
     "{T}/number_continuation.jsonl:1: field 'continuation' is 5, not a string"),
    (["--continuations", "{T}/missing.jsonl"], "{T}/missing.jsonl: No such file or directory"),
    (["--continuations", "{T}/continuations.jsonl", "--out", "{T}/continuations.jsonl"],
     "--out {T}/continuations.jsonl is the input {T}/continuations.jsonl"),
    (["--continuations", "{T}/continuations.jsonl", "--out", "{T}/notes.txt"],
     "--out {T}/notes.txt exists: choose a new file"),
    (["--data", "{T}/val.tok", "--window", "8"], "--window is the model's window over --continuations"),
])
def test_eval(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["eval", "--checkpoint", "{T}/run", "--device", "cpu", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--out", "{T}/export"], "--out {T}/export already holds files (config.json)"),
    (["--out", "{T}/run"], "--out {T}/run is the input {T}/run"),
    (["--out", "{T}/run/hf", "--force"], "--out {T}/run/hf lies inside the input {T}/run"),
    (["--out", "{T}/new/hf", "--tokenizer", "{T}/tokB"], "tokenizer {T}/tokB has hash"),
])
def test_export_hf(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["export", "hf", "--checkpoint", "{T}/run", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--model", "{T}/hf", "--out", "{T}/hf"], "--out {T}/hf is the input {T}/hf"),
    (["--model", "{T}/hf", "--out", "{T}/run"], "{T}/run already holds a run (checkpoints/)"),
    (["--model", "{T}/hf", "--out", "{T}/export"], "--out {T}/export already holds files"),
    (["--model", "{T}/tokA", "--out", "{T}/new/run"], "{T}/tokA is not a Hugging Face model folder"),
    (["--model", "{T}/export", "--out", "{T}/new/run"], "{T}/export/config.json: model_type=None is not one we read"),
])
def test_import_hf(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["import", "hf", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["--out", "{T}/notes.txt"], "--out {T}/notes.txt already exists; choose a new file, or pass --force"),
    (["--out", "{T}/run"], "--out {T}/run is the input {T}/run"),
    (["--out", "{T}/run/m.gguf"], "--out {T}/run/m.gguf lies inside the input {T}/run"),
    (["--out", "{T}/export", "--force"], "--out {T}/export is a folder; give the file to write"),
    (["--out", "{T}/new/m.gguf", "--tokenizer", "{T}/tokB"], "tokenizer {T}/tokB has hash"),
    (["--out", "{T}/new/m.gguf", "--checkpoint", "{T}/relu2_run"],
     "llama.cpp cannot run this model: ffn='relu2'"),
    (["--out", "{T}/new/m.gguf"], "tokenizer has no merges: llama.cpp's byte-level BPE ('gpt2') needs"),
])
def test_export_gguf(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["export", "gguf", "--checkpoint", "{T}/run", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["{T}/run.gguf", "--out", "{T}/run.gguf"], "--out {T}/run.gguf is the input {T}/run.gguf"),
    (["{T}/run.gguf", "--out", "{T}/run"], "{T}/run already holds a run (checkpoints/)"),
    (["{T}/run.gguf", "--out", "{T}/export"], "--out {T}/export already holds files"),
    (["{T}/notes.txt", "--out", "{T}/new/run"], "{T}/notes.txt: not a readable GGUF file"),
    (["{T}/missing.gguf", "--out", "{T}/new/run"], "no GGUF file at {T}/missing.gguf"),
    (["{T}/run.gguf", "--out", "{T}/new/run", "--max-gib", "0.00001"], "over the --max-gib limit of 1e-05"),
])
def test_import_gguf(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["import", "gguf", *argv], message)


SWEEP = ["sweep", "--config", "{T}/tiny.toml", "--grid", "optim.lr=1e-3,2e-3", *TINY_RUN, *DATA]


@pytest.mark.parametrize("argv, message, hold_lock", [
    (["--out", "{T}/export"], "--out {T}/export already holds files", None),
    (["--out", "{T}/tiny.toml"], "--out {T}/tiny.toml is the input {T}/tiny.toml", None),
    (["--out", "{T}/new/sweep", "--set", "train.run_dir=x"], "a sweep names each point's train.run_dir itself", None),
    (["--out", "{T}/sweep", "--shard", "1/2"], "run directory {T}/sweep/lr-2e-3 is in use by pid", "sweep/lr-2e-3"),
])
def test_sweep(world, tmp_path, capsys, argv, message, hold_lock):
    check_refused(world, tmp_path, capsys, [*SWEEP, *argv], message, hold_lock=hold_lock)


@pytest.mark.parametrize("argv, message", [
    (["{T}/run", "--out", "{T}/run"], "--out {T}/run is the input {T}/run"),
    (["{T}/run", "--out", "{T}"], "--out {T} holds the input {T}/run"),
    (["{T}/run", "--out", "{T}/export"], "--out {T}/export already holds files"),
    (["{T}/missing"], "{T}/missing"),
])
def test_report(world, tmp_path, capsys, argv, message):
    check_refused(world, tmp_path, capsys, ["report", *argv], message)


@pytest.mark.parametrize("argv, message", [
    (["{T}/run", "--host", "0.0.0.0"], "--host 0.0.0.0 is reachable from other machines: give an API key"),
    (["{T}/run", "--api-key", " "], "the API key is empty"),
    (["{T}/run", "--port", "70000"], "--port must be in [0, 65535], got 70000"),
    (["{T}/run", "--threads", "0"], "--threads must be at least 1, got 0"),
    (["{T}/run", "--max-batch", "0"], "--max-batch"),
    (["{T}/run", "--tokenizer", "{T}/tokB"], "tokenizer {T}/tokB has hash"),
    (["{T}/corpus.txt"], "{T}/corpus.txt is neither a checkpoint directory"),
])
def test_serve(world, tmp_path, capsys, argv, message, monkeypatch):
    pytest.importorskip("fastapi", reason="the [serve] extra is not installed")
    monkeypatch.delenv("SCRATCHLM_API_KEY", raising=False)
    check_refused(world, tmp_path, capsys, ["serve", *argv], message)
