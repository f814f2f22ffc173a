"""The whole way through, as a user fine-tunes a downloaded model: an HF folder (a SmolLM2-, Qwen3- or
Llama-3.2-shaped model with random weights and a Llama-3-style tokenizer, both built here) -> `import hf` ->
`generate` equals HF's greedy decoding -> `data encode` of a JSONL folder with the imported tokenizer ->
`train --init-from` 20 steps with the modern recipe's optimizer (Muon) -> `export hf` -> `AutoModelForCausalLM` and
`AutoTokenizer` load it: logits equal the fine-tuned run's, ids equal ours."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from hf_models import COMMON, hf_config, hf_model
from scratchlm.cli import main
from scratchlm.generate.decoding import generate
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.pretokenize import LLAMA3_SPLIT_PATTERN
from scratchlm.train.checkpoint import load_for_inference

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

ROOT = Path(__file__).resolve().parents[1]
EOT = "<|endoftext|>"
TEXT = ("Once upon a time, in 2024, a little robot named Tim said: \"I'm 12 years old!\" He'd counted 1234 stars.\n"
        "The cat sat on the mat. THE DOG'S BALL WAS RED.\tdef f(x): return x**2  # code\n")


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def llama3_style_tokenizer(folder: Path) -> None:
    """tokenizer.json as Llama 3's is made (Split on its regex + ByteLevel, ignore_merges), within COMMON's vocab."""
    from tokenizers import Regex, decoders, models, pre_tokenizers, trainers

    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    hf.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT_PATTERN), "isolated"),
                                                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=COMMON["vocab_size"] - 2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator([TEXT] * 20, trainer)
    hf.add_special_tokens([EOT, "<|begin_of_text|>"])
    hf.save(str(folder / "tokenizer.json"))


def jsonl_folder(folder: Path) -> Path:
    folder.mkdir()
    stories = (ROOT.parent / "shared" / "data" / "fixtures" / "tinystories_sample.txt")
    documents = stories.read_text(encoding="utf-8").split(EOT) if stories.is_file() else [TEXT] * 40
    for part in range(2):
        with (folder / f"part-{part}.jsonl").open("w", encoding="utf-8") as handle:
            for text in documents[part::2]:
                handle.write(json.dumps({"text": text.strip()}) + "\n")
    return folder


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-0.6b", "llama-3.2-1b"])
def test_import_generate_finetune_export_reload(tmp_path, capsys, name):
    folder = tmp_path / "downloaded"
    hf = hf_model(hf_config(name))
    hf.save_pretrained(folder)
    llama3_style_tokenizer(folder)

    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "base")]) == 0
    base, base_config = load_for_inference(tmp_path / "base")
    tokenizer = Tokenizer.load(base_config.data.tokenizer)
    assert tokenizer.encode(TEXT) == tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")).encode(
        TEXT, add_special_tokens=False).ids
    prompt = tokenizer.encode("Once upon a time")
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(base, prompt, 12, temperature=0.0) == [theirs]

    docs = jsonl_folder(tmp_path / "docs")
    assert main(["data", "encode", "--tokenizer", str(tmp_path / "base" / "tokenizer"), "--input", str(docs),
                 "--out", str(tmp_path / "train.tok"), "--val-fraction", "0.2", "--quiet"]) == 0
    run = tmp_path / "finetuned"
    assert main(["train", "--config", str(ROOT / "configs" / "recipes" / "modern.toml"), "--init-from",
                 str(tmp_path / "base"), "--run-dir", str(run), "--quiet",
                 "--set", f"data.train_path={tmp_path / 'train.tok'}",
                 "--set", f"data.val_path={tmp_path / 'train.val.tok'}",
                 "--set", "data.batch_size=4", "--set", "train.max_steps=20", "--set", "optim.warmup_iters=2",
                 "--set", "train.eval_every=10", "--set", "train.eval_batches=2", "--set", "train.log_every=5"]) == 0
    tuned, tuned_config = load_for_inference(run)
    assert tuned_config.optim.optimizer == "muon" and tuned_config.model == base_config.model
    assert not torch.equal(tuned.lm_head.weight, base.lm_head.weight)  # the 20 steps changed the weights

    capsys.readouterr()
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(tmp_path / "exported")]) == 0
    assert "custom code" not in capsys.readouterr().out
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", local_files_only=True).eval()
    assert type(back).__name__ == type(hf).__name__
    ids = torch.randint(0, COMMON["vocab_size"], (2, COMMON["max_position_embeddings"]))
    with torch.no_grad():
        assert_close(back(ids).logits, tuned(ids), rtol=1e-5, atol=1e-5)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported", local_files_only=True)
    assert auto.encode(TEXT, add_special_tokens=False) == tokenizer.encode(TEXT)
