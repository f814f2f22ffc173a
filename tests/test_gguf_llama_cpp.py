"""llama.cpp as the real client of `scratchlm export gguf`: it tokenizes as we do, decodes an f32 export greedily
to our tokens, and scores TinyStories validation text from f16 and q8_0 exports within a stated distance of our
fp32 bits per byte.

llama.cpp is llama-cpp-python built from source by scripts/setup_llama_cpp.sh into a venv of its own, driven by
benchmarks/llama_cpp_driver.py (JSON over a pipe). Without that venv these tests skip, naming the script; with CI
set they fail instead (.ci/run builds it first). Two runs are trained here for a few dozen steps on TinyStories
validation text (a model that has learnt something has clear argmaxes, so greedy decoding is a fair test): a
plain Llama (GPT-2's split pattern) and a Qwen3-shaped modern-recipe model (QK-norm, tied embeddings, grouped-query
attention, Llama 3's split pattern with merges ignored, as Llama 3's tokenizer).
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from conftest import require_shared, torch_threads
from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.config import load_config
from scratchlm.data.token_file import write_token_file
from scratchlm.generate import generate
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.pipeline import Pipeline
from scratchlm.tokenizer.pretokenize import NAMED_PATTERNS
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.checkpoint import load_for_inference
from scratchlm.train.trainer import train

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from llama_cpp_client import llama_cpp_python, llama_cpp_venv, run_llama_cpp  # noqa: E402

pytest.importorskip("gguf", reason="the [gguf] extra is not installed")
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
EOT = "<|endoftext|>"
ADVERSARIAL = [
    "Once upon a time, there was a little cat named Tom.",
    "Lily said: \"I don't know!\"<|endoftext|>Then Ben ran  away   quickly.\n\n",
    "<|endoftext|><|endoftext|>x<|endoftext",
    "naïve café – “quotes” 🐱🐶 日本語 \t tabs\r\nand 123456 numbers'll've'S'T",
    " leading space and trailing spaces   ",
    "\n\n\n   \t\t\n x\u00a0y\u2009z\u3000w",
    "a1b22c333d4444 3.14159 -42 1,000,000",
    "ALL CAPS Don'T WE'LL they'RE I'm ok",
    "emoji 👩‍👩‍👧‍👦 flags 🇫🇷 ZWJ\u200dend combining e\u0301 Hangul 한국어 Arabic مرحبا",
    "}}]]))((;;..,,!!??  -- __ ** ## @@ $$ %% ^^ && ||",
    "",
]
# Allowed |bits/byte(llama.cpp, type) - bits/byte(ours, fp32)| on TinyStories validation text, for these small
# trained models: f32 is the same computation in another order (float32 rounding only), f16 rounds weights to 11
# significant bits, q8_0 to ~8 (a scale per block of 32).
BPB_TOLERANCE = {"f32": 1e-3, "f16": 0.01, "q8_0": 0.05}


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false")


@pytest.fixture(scope="module")
def llama_cpp():
    if llama_cpp_python() is None:
        reason = f"llama.cpp is not built at {llama_cpp_venv()} (run scripts/setup_llama_cpp.sh)"
        if _in_ci():
            pytest.fail(f"CI is set but {reason}: .ci/run builds it before these tests")
        pytest.skip(reason)
    return run_llama_cpp


@pytest.fixture(scope="module")
def stories() -> str:
    return require_shared("tinystories/TinyStories-valid.txt").read_text(encoding="utf-8")


def _tokenizer(folder: Path, text: str, pattern: str) -> Tokenizer:
    (folder / "train.txt").write_text(text, encoding="utf-8")
    vocab, merges = train_bpe(str(folder / "train.txt"), 512, [EOT], pattern=NAMED_PATTERNS[pattern], num_workers=1)
    pipeline = Pipeline(NAMED_PATTERNS[pattern], ignore_merges=pattern == "llama3")  # as Llama 3's tokenizer
    return Tokenizer(vocab, merges, [EOT], pipeline=pipeline)


def _trained_run(folder: Path, tokenizer: Tokenizer, text: str, **model) -> Path:
    """folder/run: the tiny preset with these model switches (context 64), trained 60 steps on text."""
    tokenizer.save(folder / "tok")
    write_token_file(folder / "t.tok", tokenizer.encode(text), vocab_size=tokenizer.vocab_size,
                     tokenizer_hash=tokenizer.hash)
    overrides = [f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
                 for key, value in model.items()]
    config = load_config(CONFIGS / "tiny.toml", [
        f"data.train_path={folder / 't.tok'}", f"data.val_path={folder / 't.tok'}", f"data.tokenizer={folder / 'tok'}",
        f"model.vocab_size={tokenizer.vocab_size}", "model.context_length=64", *overrides, "data.batch_size=16",
        f"train.run_dir={folder / 'run'}", "train.max_steps=60", "train.eval_every=60", "train.eval_batches=1",
        "train.checkpoint_every=60", "optim.lr=1e-2", "optim.warmup_iters=5"])
    with torch_threads(1):
        assert train(config, quiet=True).status == "finished"
    return folder / "run"


RUNS = {"plain": ("gpt2", {}),
        "modern": ("llama3", dict(qk_norm=True, tie_embeddings=True, num_kv_heads=2, head_dim=32))}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, stories) -> dict[str, tuple[Path, dict[str, Path]]]:
    """{name: (run, {type: exported .gguf})} for the two runs, each exported as f32, f16 and q8_0."""
    built = {}
    for name, (pattern, model) in RUNS.items():
        folder = tmp_path_factory.mktemp(name)
        tokenizer = _tokenizer(folder, stories[:200_000], pattern)
        run = _trained_run(folder, tokenizer, stories[:300_000], **model)
        files = {}
        for gguf_type in ("f32", "f16", "q8_0"):
            files[gguf_type] = folder / f"{name}.{gguf_type}.gguf"
            assert main(["export", "gguf", "--checkpoint", str(run), "--out", str(files[gguf_type]),
                         "--type", gguf_type]) == 0
        built[name] = (run, files)
    return built


@pytest.mark.parametrize("pattern", ["gpt2", "llama3", "qwen2"])
def test_llama_cpp_tokenizes_adversarial_text_as_we_do(llama_cpp, tmp_path, stories, pattern):
    tokenizer = _tokenizer(tmp_path, stories[:100_000], pattern)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size))
    write_run(model, tokenizer, tmp_path / "run")
    assert main(["export", "gguf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "m.gguf")]) == 0
    texts = [*ADVERSARIAL, stories[500_000:502_000]]
    reply = llama_cpp([{"model": str(tmp_path / "m.gguf"), "n_ctx": 32, "jobs": [{"op": "tokenize", "texts": texts}]}])
    for text, theirs in zip(texts, reply["results"][0][0]):
        assert theirs == tokenizer.encode(text), text


@pytest.mark.parametrize("name", RUNS)
def test_llama_cpp_decodes_an_f32_export_greedily_as_we_do(llama_cpp, runs, name, capsys):
    run, files = runs[name]
    model, _ = load_for_inference(run)
    tokenizer = Tokenizer.load(run / "tokenizer")
    prompt = tokenizer.encode("Once upon a time, there was a little")
    with torch_threads(1):
        ours = generate(model, prompt, 24, temperature=0.0)[0]
        with torch.no_grad():
            our_logits = model(torch.tensor([prompt]))[0]
    jobs = [{"op": "greedy", "prompt": prompt, "max_tokens": 24}, {"op": "logits", "tokens": prompt}]
    theirs, their_logits = llama_cpp([{"model": str(files["f32"]), "n_ctx": 64, "f32_cache": True,
                                       "jobs": jobs}])["results"][0]
    assert theirs == ours, (tokenizer.decode(theirs), tokenizer.decode(ours))
    torch.testing.assert_close(torch.tensor(their_logits), our_logits, rtol=0, atol=1e-4)
    # `scratchlm generate --temperature 0` prints the same continuation, up to the end of the document.
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(run), "--prompt", "Once upon a time, there was a little",
                 "--max-new-tokens", "24", "--temperature", "0"]) == 0
    eot = tokenizer.special_id(EOT)
    document = ours[:ours.index(eot)] if eot in ours else ours
    assert f"Once upon a time, there was a little{tokenizer.decode(document)}" in capsys.readouterr().out


@pytest.mark.parametrize("switches", [
    dict(num_kv_heads=2, tie_embeddings=True, rope_theta=500_000.0, rope_scaling="llama3", rope_original_context=64),
    dict(qkv_bias=True, num_kv_heads=1),
    dict(qk_norm=True, head_dim=32, num_kv_heads=2),
    dict(d_model=256, num_layers=4, num_heads=4, d_ff=704, qk_norm=True),  # the demo's (modern recipe) shape
], ids=["llama-gqa-tied-llama3", "qwen2-biases", "qwen3-qk-norm", "demo-shape"])
def test_llama_cpp_logits_equal_ours_for_each_architecture(llama_cpp, tmp_path, switches):
    """Random weights (non-trivial gains and biases) in each layout llama.cpp runs, over a 60-token prompt, so that
    Llama 3's rope_freqs, the biases and QK-norm all show: llama.cpp's f32 logits equal ours within 1e-4."""
    torch.manual_seed(0)
    tokenizer = Tokenizer({i: bytes([i]) for i in range(256)} | {256: b"th"}, [(b"t", b"h")], [EOT])
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=258, context_length=64, **switches)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.normal_()
    write_run(model, tokenizer, tmp_path / "run")
    assert main(["export", "gguf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "m.gguf")]) == 0
    tokens = torch.randint(0, 256, (60,)).tolist()
    reply = llama_cpp([{"model": str(tmp_path / "m.gguf"), "n_ctx": 64, "f32_cache": True,
                        "jobs": [{"op": "logits", "tokens": tokens}]}])
    with torch.no_grad():
        ours = model(torch.tensor([tokens]))[0]
    torch.testing.assert_close(torch.tensor(reply["results"][0][0]), ours, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", RUNS)
def test_bits_per_byte_through_llama_cpp_per_type(llama_cpp, runs, stories, name):
    """TinyStories validation text (past what the runs trained on), in windows of the model's context: llama.cpp's
    bits per byte from each type against ours in fp32."""
    run, files = runs[name]
    model, _ = load_for_inference(run)
    tokenizer = Tokenizer.load(run / "tokenizer")
    ids = tokenizer.encode(stories[600_000:640_000])
    size = model.config.context_length
    windows = [ids[start:start + size] for start in range(0, len(ids) - size + 1, size)][:40]
    scored_bytes = sum(len(tokenizer.decode_bytes(window[1:])) for window in windows)
    with torch_threads(1), torch.no_grad():
        batch = torch.tensor(windows)
        log_probs = torch.log_softmax(model(batch).double(), dim=-1)[:, :-1]
        ours = -log_probs.gather(-1, batch[:, 1:, None]).sum().item()
    ours_bpb = ours / math.log(2) / scored_bytes
    request = [{"model": str(files[t]), "n_ctx": size, "jobs": [{"op": "nll", "windows": windows}]} for t in files]
    reply = llama_cpp(request)["results"]
    figures = {t: sum(result[0]) / math.log(2) / scored_bytes for t, result in zip(files, reply)}
    print(f"{name}: bits/byte on {scored_bytes:,} bytes of TinyStories validation text: ours fp32 {ours_bpb:.5f}; "
          + "; ".join(f"llama.cpp {t} {bpb:.5f} ({bpb - ours_bpb:+.5f})" for t, bpb in figures.items()))
    for gguf_type, bpb in figures.items():
        assert abs(bpb - ours_bpb) <= BPB_TOLERANCE[gguf_type], (gguf_type, bpb, ours_bpb)
