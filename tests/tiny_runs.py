"""A BPE tokenizer trained on a short text and a tiny-preset run trained on that text: what the evaluation tests
(test_eval_bpb.py, test_eval_continuations.py) score, built the same way for both."""

from __future__ import annotations

from pathlib import Path

from conftest import torch_threads
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.tokenizer.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EOT = "<|endoftext|>"


def text_tokenizer(folder: Path, text: str, vocab_size: int = 300) -> Tokenizer:
    """A tokenizer trained on text (written to folder/text.txt), with <|endoftext|> as its special token."""
    (folder / "text.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(str(folder / "text.txt"), vocab_size, [EOT])
    return Tokenizer(vocab, merges, [EOT])


def train_tiny_run(folder: Path, tokenizer: Tokenizer, text: str, *, steps: int, batch_size: int) -> Path:
    """folder/run, finished: the tiny preset trained for steps (one evaluation and one checkpoint, at the end) on
    text encoded as folder/t.tok, its validation file too, with tokenizer saved as folder/tok (the run's
    data.tokenizer)."""
    tokenizer.save(folder / "tok")
    write_token_file(folder / "t.tok", tokenizer.encode(text), vocab_size=tokenizer.vocab_size,
                     tokenizer_hash=tokenizer.hash)
    config = load_config(CONFIGS / "tiny.toml", [
        f"data.train_path={folder / 't.tok'}", f"data.val_path={folder / 't.tok'}", f"data.tokenizer={folder / 'tok'}",
        f"model.vocab_size={tokenizer.vocab_size}", f"data.batch_size={batch_size}", f"train.run_dir={folder / 'run'}",
        f"train.max_steps={steps}", f"train.eval_every={steps}", "train.eval_batches=1",
        f"train.checkpoint_every={steps}", "optim.warmup_iters=1"])
    with torch_threads(1):
        assert train(config, quiet=True).status == "finished"
    return folder / "run"
