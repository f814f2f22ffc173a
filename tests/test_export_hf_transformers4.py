"""An export loads in transformers 4.x too, in each architecture export writes, with the right RoPE and equal logits.

transformers 5 spells RoPE as ``rope_parameters``, 4.x as ``rope_theta`` (+ ``rope_scaling``); an export that only
wrote the 5.x spelling would load in 4.x with the default θ = 10000, silently. Our export writes both. The check
needs a Python with transformers 4.x beside torch (scripts/test_transformers_versions.sh makes one and names it in
SCRATCHLM_TRANSFORMERS4_PYTHON); the model is exported here, loaded there, and the logits compared here.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe

OLD_PYTHON = os.environ.get("SCRATCHLM_TRANSFORMERS4_PYTHON")
pytestmark = pytest.mark.skipif(not OLD_PYTHON, reason="needs SCRATCHLM_TRANSFORMERS4_PYTHON, a Python with "
                                "transformers 4.x and torch (scripts/test_transformers_versions.sh sets it)")

LOAD_IN_OLD_TRANSFORMERS = """
import sys, torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
folder, ids_file, out_file = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
with torch.no_grad():
    logits = model(torch.load(ids_file)).logits
torch.save({"rope_theta": model.config.rope_theta, "rope_scaling": model.config.rope_scaling, "logits": logits,
            "class": type(model).__name__, "version": transformers.__version__}, out_file)
"""


@pytest.mark.parametrize(("switches", "class_name"), [
    ({}, "LlamaForCausalLM"),
    (dict(num_kv_heads=2, tie_embeddings=True, rope_scaling="llama3", rope_original_context=8), "LlamaForCausalLM"),
    (dict(qkv_bias=True, num_kv_heads=1), "Qwen2ForCausalLM"),
    (dict(qk_norm=True, num_kv_heads=2, head_dim=32), "Qwen3ForCausalLM"),
])
def test_transformers_4_loads_export_with_rope_theta_and_equal_logits(tmp_path, switches, class_name):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a little cat named Tom. " * 40, encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    tokenizer = Tokenizer(vocab, merges, ["<|endoftext|>"])
    torch.manual_seed(0)
    # A θ far from the 10000 default, so a loader that ignored it would give other logits.
    cfg = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, rope_theta=500_000.0, **switches)
    model = TransformerLM(cfg).eval()
    write_run(model, tokenizer, tmp_path / "run")
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), generator=torch.Generator().manual_seed(1))
    torch.save(ids, tmp_path / "ids.pt")

    subprocess.run([OLD_PYTHON, "-c", LOAD_IN_OLD_TRANSFORMERS, str(tmp_path / "hf"), str(tmp_path / "ids.pt"),
                    str(tmp_path / "out.pt")], check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})

    loaded = torch.load(tmp_path / "out.pt")
    assert loaded["rope_theta"] == 500_000.0, f"transformers {loaded['version']} read rope_theta wrongly"
    assert loaded["class"] == class_name
    assert (loaded["rope_scaling"] or {}).get("rope_type", "default") == cfg.rope_scaling.replace("none", "default")
    with torch.no_grad():
        ours = model(ids)
    torch.testing.assert_close(loaded["logits"], ours, rtol=1e-4, atol=1e-4)

