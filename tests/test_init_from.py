"""`scratchlm train --init-from PATH`: weights, model config and tokenizer from a run or a Hugging Face folder, a
fresh optimizer (AdamW and the modern recipe's Muon), schedule and step counter; refusals of another model or
tokenizer; a resume that never reads the source again.

Oracles: the first logged loss of a run started from weights is the loss of those weights on the run's first
batch, computed here with F.cross_entropy on the source model (ours, or transformers' LlamaForCausalLM).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from scratchlm.cli import main
from scratchlm.config import load_config
from scratchlm.data.batches import BatchSampler
from scratchlm.data.token_file import open_token_file, write_token_file
from scratchlm.model import TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.train.checkpoint import load_for_inference
from scratchlm.train.trainer import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
RECIPES = {"adamw": CONFIGS / "tiny.toml", "muon": CONFIGS / "recipes" / "modern.toml"}
SENTENCES = [b"the cat sat on the mat. ", b"a dog ran to the park. ", b"we like red apples! "]
# Short runs: batch 4, one warm-up step (the modern recipe's 20 would not fit), a loss record every step.
# fp32: the first step's loss is compared with a float32 forward (the modern recipe's auto may take bf16)
SHORT = ["--set", "data.batch_size=4", "--set", "optim.warmup_iters=1", "--set", "train.log_every=1",
         "--set", "train.eval_batches=1", "--set", "train.device=cpu", "--set", "train.dtype=fp32", "--quiet"]


pytestmark = pytest.mark.usefixtures("one_thread_module")


def byte_tokenizer(shift: int) -> Tokenizer:
    """256 single-byte tokens, ids rotated by ``shift``: the same size for any shift, another hash."""
    return Tokenizer({(byte + shift) % 256: bytes([byte]) for byte in range(256)}, [], [])


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    """Two tokenizers, token files of each, and a source run trained with tokenizer A."""
    root = tmp_path_factory.mktemp("init")
    order = np.random.default_rng(1).integers(0, len(SENTENCES), 600)
    text = b"".join(SENTENCES[i] for i in order)
    for name, shift in (("a", 0), ("b", 1)):
        tokenizer = byte_tokenizer(shift)
        tokenizer.save(root / f"tok_{name}")
        ids = np.array(tokenizer.encode(text.decode()))
        write_token_file(root / f"train_{name}.tok", ids, vocab_size=256, tokenizer_hash=tokenizer.hash)
        write_token_file(root / f"val_{name}.tok", ids[:2000], vocab_size=256, tokenizer_hash=tokenizer.hash)
    config = load_config(RECIPES["adamw"], [*data_overrides(root, "a"), f"data.tokenizer={root}/tok_a",
                                            f"train.run_dir={root}/source", "data.batch_size=4", "optim.lr=1e-2",
                                            "train.max_steps=8", "train.eval_every=8", "train.checkpoint_every=8"])
    assert train(config, quiet=True).status == "finished"
    return root


def data_overrides(root: Path, name: str) -> list[str]:
    return [f"data.train_path={root}/train_{name}.tok", f"data.val_path={root}/val_{name}.tok"]


def data_args(root: Path, name: str = "a") -> list[str]:
    return [arg for item in data_overrides(root, name) for arg in ("--set", item)]


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def first_batch_loss(model: torch.nn.Module, run_dir: Path) -> float:
    """The loss of ``model`` (any callable ids -> logits) on the first batch the run at ``run_dir`` trained on."""
    config = load_config(run_dir / "config.toml")
    tokens = open_token_file(config.data.train_path).tokens
    sampler = BatchSampler(tokens, config.micro_batch_size, config.model.context_length, torch.device("cpu"),
                           seed=config.train.seed)
    inputs, targets = sampler.next()
    with torch.inference_mode():
        logits = model(inputs)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten()).item()


@pytest.fixture(scope="module", params=sorted(RECIPES))
def fine_tuned(request, world) -> tuple[str, Path]:
    """(optimizer, a 4-step run of that recipe started from the source run's weights)."""
    run_dir = world / f"fine_tuned_{request.param}"
    # model.d_model=64 is the source's own value: a stated model field that agrees is fine.
    assert main(["train", "--config", str(RECIPES[request.param]), "--init-from", str(world / "source"),
                 *data_args(world), *SHORT, "--set", "train.max_steps=4", "--set", "train.checkpoint_every=2",
                 "--set", "model.d_model=64", "--run-dir", str(run_dir)]) == 0
    return request.param, run_dir


def test_the_first_step_starts_from_the_source_weights(world, fine_tuned):
    optimizer, run_dir = fine_tuned
    source, source_config = load_for_inference(world / "source")
    expected = first_batch_loss(source, run_dir)
    torch.manual_seed(0)
    fresh = first_batch_loss(TransformerLM(source_config.model), run_dir)
    logged = records(run_dir, "train")
    assert abs(expected - fresh) > 0.1  # the source learned something: its loss tells its weights apart
    assert logged[0]["loss"] == pytest.approx(expected, rel=1e-5)
    config = load_config(run_dir / "config.toml")
    assert config.model == source_config.model  # the recipe's [model] table (modern: vocab 4096, d 256) not used
    assert config.optim.optimizer == optimizer
    assert config.data.tokenizer_hash == source_config.data.tokenizer_hash == byte_tokenizer(0).hash
    assert Tokenizer.load(run_dir / "tokenizer").hash == byte_tokenizer(0).hash  # the run's own copy


def test_the_optimizer_schedule_and_step_counter_start_fresh(fine_tuned):
    _, run_dir = fine_tuned
    logged = records(run_dir, "train")
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert logged[0]["lr"] == 0.0  # step 1 trains at the warm-up's first rate, as a new run does
    state = load_file(str(run_dir / "checkpoints" / "step_0000004" / "optimizer.safetensors"))
    steps = [tensor.item() for name, tensor in state.items() if name.endswith(".step")]
    assert steps and all(step == 4 for step in steps)  # AdamW's counts: this run's 4 steps, not the source's 8+4


def test_resume_never_reads_the_source_and_is_bitwise_identical(world, fine_tuned, tmp_path):
    """The run copied elsewhere (its train.init_from now names nothing), its last checkpoint removed as if killed
    after step 2's: the resumed losses are bitwise those of the uninterrupted run."""
    _, run_dir = fine_tuned
    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(moved / "checkpoints" / "step_0000004")
    assert not Path(load_config(moved / "config.toml").train.init_from).exists()
    assert main(["train", "--run-dir", str(moved), "--resume", "--quiet", *data_args(world)]) == 0
    assert [r["loss"] for r in records(moved, "train")] == [r["loss"] for r in records(run_dir, "train")]


@pytest.mark.parametrize(("argv", "message"), [
    (["--set", "model.d_model=32"], "model.d_model = 32 conflicts with the model of train.init_from {T}/source "
                                    "(d_model = 64): with train.init_from the model is the source's"),
    (["--set", "model.preset=tiny"], "model.preset cannot be set with train.init_from"),
    (["--set", "data.tokenizer={T}/tok_b"], "data.tokenizer {T}/tok_b is tokenizer "),
    ([*data_args(Path("{T}"), "b")], "{T}/train_b.tok was encoded with tokenizer "),  # the existing hash check
])
def test_another_model_or_tokenizer_is_refused(world, tmp_path, capsys, argv, message):
    run_dir = tmp_path / "new" / "run"
    argv = [arg.replace("{T}", str(world)) for arg in argv]
    data = [] if any("train_path" in arg for arg in argv) else data_args(world)
    capsys.readouterr()
    assert main(["train", "--config", str(RECIPES["adamw"]), "--init-from", str(world / "source"), *data, *SHORT,
                 *argv, "--run-dir", str(run_dir)]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message.replace("{T}", str(world)) in error, error
    assert not (tmp_path / "new").exists()  # nothing created


def test_init_from_a_hugging_face_llama_folder(world, tmp_path):
    """A bf16 LlamaForCausalLM saved by transformers: trained in fp32 from its weights, with its tokenizer.json."""
    transformers = pytest.importorskip("transformers")
    from scratchlm.tokenizer.formats.hf import write_hf_tokenizer

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32,
                                      rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    folder = tmp_path / "hf"
    hf.save_pretrained(folder)
    tokenizer = byte_tokenizer(0)
    write_hf_tokenizer(folder, tokenizer)
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(RECIPES["adamw"]), "--init-from", str(folder), *data_args(world), *SHORT,
                 "--set", "train.max_steps=1", "--run-dir", str(run_dir)]) == 0
    expected = first_batch_loss(lambda ids: hf.float()(ids).logits, run_dir)  # the bf16 weights, in fp32
    assert records(run_dir, "train")[0]["loss"] == pytest.approx(expected, rel=1e-5)
    saved = load_config(run_dir / "config.toml")
    assert (saved.model.d_ff, saved.model.rope_theta, saved.model.context_length) == (96, 500.0, 32)  # not tiny's
    assert saved.data.tokenizer_hash == tokenizer.hash == Tokenizer.load(run_dir / "tokenizer").hash
    model, _ = load_for_inference(run_dir)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # fp32 master weights
