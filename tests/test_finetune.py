"""`scratchlm finetune` end to end on a tiny base model: the loss mask proved by behaviour, ChatML growth of a base
model, resume bitwise with both optimizers, and the run directory as `train` writes it.

The base model is the tiny preset (context 64) trained for a few steps on random words with a BPE tokenizer that
has only <|endoftext|>: a base model without a chat template, as `scratchlm train` makes them.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from conftest import torch_threads
from scratchlm.cli import main
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EOT = "<|endoftext|>"
REPLY = "Once upon a time."
FAST = ["--set", "train.log_every=1", "--set", "train.eval_every=1000", "--set", "data.batch_size=8",
        "--device", "cpu", "--quiet"]


def records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A finished tiny run (no chat template) and its world: folder/base."""
    folder = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "once", "upon", "time", "and", "dog", "ran", "home", "."]
    text = "".join(" ".join(rng.choice(words) for _ in range(40)) + EOT for _ in range(60))
    (folder / "text.txt").write_text(text)
    tokenizer = Tokenizer(*train_bpe(str(folder / "text.txt"), 300, [EOT], num_workers=1), [EOT])
    tokenizer.save(folder / "tok")
    write_token_file(folder / "t.tok", tokenizer.encode(text), vocab_size=tokenizer.vocab_size,
                     tokenizer_hash=tokenizer.hash)
    with torch_threads(1):
        assert main(["train", "--config", str(CONFIGS / "tiny.toml"), "--set", f"data.train_path={folder}/t.tok",
                     "--set", f"data.tokenizer={folder}/tok", "--set", "model.vocab_size=none", "--set",
                     "model.context_length=64", "--set", "train.max_steps=10", "--set", "train.checkpoint_every=10",
                     "--set", "optim.warmup_iters=1", "--run-dir", str(folder / "base"), "--quiet"]) == 0
    return folder / "base"


def conversations(path: Path, count: int, seed: int) -> Path:
    """Conversations whose user turn is random letters and whose assistant turn is always REPLY."""
    rng = random.Random(seed)
    with path.open("w") as file:
        for _ in range(count):
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(rng.randint(10, 30)))
            file.write(json.dumps({"messages": [{"role": "user", "content": prompt},
                                                {"role": "assistant", "content": REPLY}]}) + "\n")
    return path


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_the_loss_nears_zero_only_when_the_prompt_is_masked(base, tmp_path, train_on_prompt):
    """The assistant always says the same thing, the user says random things: a model can learn the reply exactly,
    never the prompt. So the training loss goes near zero when it counts the reply alone, and stays high when it
    counts the prompt too."""
    data = conversations(tmp_path / "chat.jsonl", 64, seed=1)
    argv = ["finetune", "--init-from", str(base), "--data", str(data), "--run-dir", str(tmp_path / "run"),
            "--set", "train.max_steps=60", "--set", "optim.lr=1e-2", "--set", "optim.min_lr=1e-3", "--set",
            "data.val_fraction=0", *FAST]
    with torch_threads(1):
        assert main(argv + (["--train-on-prompt"] if train_on_prompt else [])) == 0
    last = sum(r["loss"] for r in records(tmp_path / "run", "train")[-5:]) / 5
    if train_on_prompt:
        assert last > 0.8  # the random letters cannot be learned (measured: ~1.3)
    else:
        assert last < 0.01  # (measured: ~0.0002)


def test_a_base_model_grows_chatml(base, tmp_path):
    """Two special tokens after the vocabulary, the model's rows grown for them, and the template kept with the
    run's tokenizer, whose hash the run records."""
    data = conversations(tmp_path / "chat.jsonl", 16, seed=2)
    run = tmp_path / "run"
    with torch_threads(1):
        assert main(["finetune", "--init-from", str(base), "--data", str(data), "--run-dir", str(run),
                     "--set", "train.max_steps=2", "--set", "optim.warmup_iters=1", *FAST]) == 0
    old = Tokenizer.load(base / "tokenizer")
    tokenizer = Tokenizer.load(run / "tokenizer")
    assert old.chat_template is None and tokenizer.chat_template is not None
    assert tokenizer.special_tokens == [EOT, "<|im_start|>", "<|im_end|>"]
    assert [tokenizer.special_id("<|im_start|>"), tokenizer.special_id("<|im_end|>")] == [old.vocab_size,
                                                                                          old.vocab_size + 1]
    assert tokenizer.end_of_turn_ids == (old.vocab_size + 1,)
    config = load_config(run / "config.toml")
    assert config.model.vocab_size == old.vocab_size + 2
    assert config.data.tokenizer_hash == tokenizer.hash != old.hash
    step = sorted((run / "checkpoints").glob("step_*"))[-1]
    assert json.loads((step / "config.json").read_text())["data"]["tokenizer_hash"] == tokenizer.hash


def test_new_rows_start_as_the_mean(base, tmp_path):
    """The weights a fine-tuning starts from: the base model's rows, and for each new token the mean of them."""
    from scratchlm.finetune.data import ConversationData
    from scratchlm.init_source import open_source
    from scratchlm.train.init_from import adopt

    data_path = conversations(tmp_path / "chat.jsonl", 4, seed=3)
    config = load_config(CONFIGS / "finetune.toml", [f"data.train_path={data_path}", f"train.init_from={base}",
                                                     "data.val_fraction=0"])
    source = open_source(base)
    before = source.weights["token_embeddings.weight"].clone()
    config = adopt(config, source, {})
    config, tokenizer = ConversationData.read(config, quiet=True).prepare(config, source.read_tokenizer, source)
    grown = source.weights["token_embeddings.weight"]
    assert grown.shape[0] == before.shape[0] + 2 == config.model.vocab_size
    assert torch.equal(grown[:before.shape[0]], before)
    torch.testing.assert_close(grown[-1], before.double().mean(0).float())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_resume_is_bitwise_the_uninterrupted_run(base, tmp_path, optimizer):
    data = conversations(tmp_path / "chat.jsonl", 40, seed=4)
    run = tmp_path / "run"
    argv = [*FAST, "--set", "train.max_steps=6", "--set", "train.checkpoint_every=3", "--set",
            "optim.warmup_iters=1", "--set", f"optim.optimizer={optimizer}", "--set", "data.val_fraction=0.1",
            "--set", "train.eval_every=3"]
    with torch_threads(1):
        assert main(["finetune", "--init-from", str(base), "--data", str(data), "--run-dir", str(run), *argv]) == 0
        moved = tmp_path / "moved"
        shutil.copytree(run, moved)
        shutil.rmtree(moved / "checkpoints" / "step_0000006")  # as if killed after step 3's checkpoint
        assert main(["finetune", "--resume", "--run-dir", str(moved), "--quiet"]) == 0
    assert [r["loss"] for r in records(moved, "train")] == [r["loss"] for r in records(run, "train")]
    assert [r["val_loss"] for r in records(moved, "eval")] == [r["val_loss"] for r in records(run, "eval")]
    assert len(records(run, "eval")) == 2


def test_packed_and_padded_give_the_same_loss(base, tmp_path):
    """One step over 8 conversations: padded, a batch of 8 rows holds each once; packed, they fill fewer rows, which
    a batch of 8 draws equally often. Either way every conversation weighs alike, and packing never changes what the
    model computes for one (document masking), so the first loss agrees."""
    data = conversations(tmp_path / "chat.jsonl", 8, seed=5)
    losses = {}
    for packing in ("packed", "padded"):
        with torch_threads(1):
            assert main(["finetune", "--init-from", str(base), "--data", str(data), "--run-dir",
                         str(tmp_path / packing), "--packing", packing, "--set", "train.max_steps=1", "--set",
                         "optim.warmup_iters=0", "--set", "data.val_fraction=0", *FAST]) == 0
        losses[packing] = records(tmp_path / packing, "train")[0]["loss"]
    assert losses["packed"] == pytest.approx(losses["padded"], rel=1e-5)


def test_an_instruct_model_keeps_its_template(tmp_path):
    """A Hugging Face instruct folder (a tiny random SmolLM2-shaped model with SmolLM2-135M-Instruct's real template
    and added tokens) as --init-from: no ChatML is added, the vocabulary stays, the run keeps the model's template."""
    pytest.importorskip("transformers")
    from conftest import require_shared
    from hf_models import hf_config, hf_model
    from scratchlm.compat.hf_import import read_hf_tokenizer
    from test_chat_template import _hf_folder

    bpe = train_bpe(require_shared("fixtures/tinystories_sample.txt"), 400, [], num_workers=1)
    folder = _hf_folder("SmolLM2-135M-Instruct", bpe, tmp_path / "smol")
    tokenizer = Tokenizer.load(folder)
    config = hf_config("smollm2-135m")
    config.vocab_size, config.max_position_embeddings = tokenizer.vocab_size, 256  # room for its system prompt
    hf_model(config).save_pretrained(folder)
    data = conversations(tmp_path / "chat.jsonl", 16, seed=6)
    run = tmp_path / "run"
    with torch_threads(1):
        assert main(["finetune", "--init-from", str(folder), "--data", str(data), "--run-dir", str(run), "--set",
                     "train.max_steps=2", "--set", "optim.warmup_iters=1", *FAST]) == 0
    kept, read = Tokenizer.load(run / "tokenizer"), read_hf_tokenizer(folder)  # as --init-from reads the folder
    assert kept.chat_template.source == tokenizer.chat_template.source
    assert kept.special_tokens == tokenizer.special_tokens and kept.hash == read.hash
    assert kept.end_of_turn_ids == read.end_of_turn_ids
    assert load_config(run / "config.toml").model.vocab_size == tokenizer.vocab_size
    assert all(r["loss"] < 20 for r in records(run, "train"))


def test_a_finetuned_export_answers_in_transformers_as_we_do(base, tmp_path):
    """Base run -> finetune (ChatML) -> export hf: transformers renders the conversation with the exported template
    to our ids, and its greedy generate() gives our greedy reply, stopping at the same end of turn."""
    transformers = pytest.importorskip("transformers")
    from scratchlm.generate.chat import ChatSession
    from scratchlm.train.checkpoint import load_for_inference

    data = conversations(tmp_path / "chat.jsonl", 64, seed=3)
    run = tmp_path / "run"
    with torch_threads(1):
        assert main(["finetune", "--init-from", str(base), "--data", str(data), "--run-dir", str(run),
                     "--set", "train.max_steps=40", "--set", "optim.lr=1e-2", "--set", "data.val_fraction=0",
                     *FAST]) == 0
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "hf")]) == 0
    model, config = load_for_inference(run)
    tokenizer = Tokenizer.load(config.data.tokenizer)
    messages = [{"role": "user", "content": "tell me something"}]
    ours = "".join(ChatSession(model, tokenizer, temperature=0, max_new_tokens=12).reply(messages[0]["content"]))

    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompt = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt == tokenizer.encode_chat(messages, add_generation_prompt=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True).eval()
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):].tolist()
    end_of_turn = tokenizer.special_id("<|im_end|>")
    assert theirs[-1] == end_of_turn  # learned: the fixed reply, then the end of the turn, where generate() stops
    assert ours == REPLY == tokenizer.decode(theirs[:-1])


def test_a_fine_tuning_run_speaks_as_finetune():
    """The start-up and budget lines of a fine-tuning run name `scratchlm finetune`, not train."""
    from scratchlm.train.resolve import command_name

    config = load_config(CONFIGS / "finetune.toml")
    assert command_name(config) == "scratchlm finetune"
    assert command_name(load_config(CONFIGS / "tiny.toml")) == "scratchlm train"
