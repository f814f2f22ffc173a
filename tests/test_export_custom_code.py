"""The custom-code export: transformers builds any TransformerLM from the folder, with equal logits and generation.

Oracles: our own TransformerLM (logits, with and without left padding, and its loss) and our greedy generation
(scratchlm.generate.sampling), against `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`
and its `generate()`, for switch combinations that no standard architecture holds. Every parameter is moved off
its initial constant first (zero-initialised projections, gains of 1, biases of 0), so each one matters.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys

import pytest
import torch

from scratchlm.compat.hf_custom_code import CONFIG_FILE, MODELING_FILE, export_custom_code
from scratchlm.compat.hf_export import export_hf
from scratchlm.generate.decoding import generate
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.hf import EOS_TOKEN
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.loss import cross_entropy

transformers = pytest.importorskip("transformers")

CASES = {
    # modded-nanogpt's recipe: squared ReLU, QK-norm, soft-capped logits, zero-initialised residual projections.
    "modern": dict(ffn="relu2", qk_norm=True, logit_softcap=15.0, zero_init_residual=True),
    "layernorm_post": dict(norm="layernorm", norm_position="post"),
    "no_norm": dict(norm="none", ffn="relu2"),
    "nope": dict(position="nope", ffn="silu"),
    "silu_tied": dict(ffn="silu", tie_embeddings=True),
    "tied_softcap": dict(tie_embeddings=True, logit_softcap=5.0, qk_norm=True),
    # The switches of pretrained checkpoints: grouped-query attention, a head size of its own, q/k/v biases,
    # Llama 3.1's RoPE scaling (with an original context short enough that it changes the frequencies used here).
    "gqa_bias_llama3": dict(num_heads=4, num_kv_heads=2, head_dim=24, qkv_bias=True, rope_scaling="llama3",
                            rope_scaling_factor=4.0, rope_original_context=16, ffn="relu2", logit_softcap=30.0),
    "multi_query_post": dict(num_kv_heads=1, norm_position="post", norm="layernorm", qk_norm=True),
}
CORPUS = ("Once upon a time there was a little girl named Lily. She liked to play with her cat Tom. "
          "One day, Tom ran away and Lily was sad. Ben said: \"Don't worry, we'll find him!\" ") * 20


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(f"{CORPUS}<|endoftext|>", encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, [EOS_TOKEN])
    return Tokenizer(vocab, merges, [EOS_TOKEN])


def random_model(tokenizer: Tokenizer, **overrides) -> TransformerLM:
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, **overrides)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norm gains around 1, biases around 0
                param.uniform_(0.5, 1.5) if name.endswith("weight") and "proj" not in name else param.normal_(0, 0.1)
            elif not param.any():  # a zero-initialised projection
                param.normal_(0, 0.05)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tokenizer, tmp_path_factory):
    """(our model, the folder, transformers' model loaded from it) for one case of CASES."""
    model = random_model(tokenizer, **CASES[request.param])
    # transformers copies the modeling files to a module folder named after the export folder: one name per case.
    out = tmp_path_factory.mktemp(request.param) / f"scratchlm_{request.param}"
    export_custom_code(model, tokenizer, out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return model, out, loaded


def test_logits_equal_ours(exported):
    model, _, loaded = exported
    assert type(loaded).__name__ == "ScratchLMForCausalLM"
    ids = torch.randint(0, model.config.vocab_size, (3, model.config.context_length),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids), rtol=1e-5, atol=1e-5)


def test_left_padded_logits_and_loss_equal_ours(exported):
    model, _, loaded = exported
    ids = torch.randint(0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(2))
    real = torch.ones_like(ids, dtype=torch.bool)
    real[0, :7], real[2, :1] = False, False  # left padding of 7 and 1 tokens; row 1 has none
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=real), loaded(ids, attention_mask=real.long()).logits
        torch.testing.assert_close(theirs[real], ours[real], rtol=1e-5, atol=1e-5)
        loss = loaded(ids, labels=ids).loss
    torch.testing.assert_close(loss, cross_entropy(model(ids)[:, :-1], ids[:, 1:]), rtol=1e-5, atol=1e-6)


def _their_greedy(loaded, prompts: list[list[int]], new_tokens: int, eos_id: int) -> list[list[int]]:
    """transformers' greedy continuation of left-padded prompts, each cut before its first eos (as ours stops)."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = loaded.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False)
    rows = out[:, width:].tolist()
    return [row[:row.index(eos_id)] if eos_id in row else row for row in rows]


@pytest.mark.parametrize("lengths", [(6,), (6, 6), (3, 9, 5)], ids=["single", "batch", "left_padded"])
def test_greedy_generate_equals_ours(exported, tokenizer, lengths):
    model, _, loaded = exported
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, tokenizer.vocab_size, (n,), generator=generator).tolist() for n in lengths]
    new_tokens = model.config.context_length - max(lengths)  # up to the context: ours would slide past it
    eos_id = tokenizer.special_id(EOS_TOKEN)
    ours = generate(model, prompts, new_tokens, temperature=0, eos_id=eos_id)
    assert _their_greedy(loaded, prompts, new_tokens, eos_id) == ours
    assert any(len(row) > 1 for row in ours)  # no empty comparison


def test_config_holds_every_model_field_and_the_auto_map(exported, tokenizer):
    model, out, loaded = exported
    document = json.loads((out / "config.json").read_text(encoding="utf-8"))
    assert document["model_type"] == "scratchlm" and document["architectures"] == ["ScratchLMForCausalLM"]
    assert document["auto_map"] == {"AutoConfig": "configuration_scratchlm.ScratchLMConfig",
                                    "AutoModelForCausalLM": "modeling_scratchlm.ScratchLMForCausalLM"}
    assert document["bos_token_id"] == document["eos_token_id"] == tokenizer.special_id(EOS_TOKEN)
    fields = dict(model.config.to_dict())
    fields["rope_scaling_type"] = fields.pop("rope_scaling")
    assert {name: document[name] for name in fields} == fields
    assert loaded.config.hidden_size == model.config.d_model  # transformers' names are aliases of ours
    assert loaded.config.num_hidden_layers == model.config.num_layers
    assert loaded.generation_config.eos_token_id == tokenizer.special_id(EOS_TOKEN)
    assert {p.name for p in out.iterdir()} == {"config.json", CONFIG_FILE, MODELING_FILE, "model.safetensors",
                                               "tokenizer.json", "tokenizer_config.json"}


def test_modeling_files_import_only_torch_and_transformers(exported):
    _, out, _ = exported
    for name in (CONFIG_FILE, MODELING_FILE):
        tree = ast.parse((out / name).read_text(encoding="utf-8"))
        imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                     if isinstance(node, ast.ImportFrom) and node.level == 0}
        assert imported <= {"math", "torch", "transformers"}, (name, imported)
        assert "scratchlm" not in imported


LOAD_WITHOUT_SCRATCHLM = """
import sys
sys.modules["scratchlm"] = None  # any import of scratchlm now fails
import torch, transformers
folder, ids_file, out_file = sys.argv[1:]
model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = torch.load(ids_file)
with torch.no_grad():
    logits = model(ids).logits
    tokens = model.generate(ids[:, :4], attention_mask=torch.ones_like(ids[:, :4]), max_new_tokens=8,
                            do_sample=False)
torch.save({"logits": logits, "tokens": tokens}, out_file)
"""


def test_folder_alone_loads_in_another_process(tokenizer, tmp_path):
    model = random_model(tokenizer, **CASES["modern"])
    export_custom_code(model, tokenizer, tmp_path / "scratchlm_alone")
    ids = torch.randint(0, tokenizer.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    torch.save(ids, tmp_path / "ids.pt")
    subprocess.run([sys.executable, "-c", LOAD_WITHOUT_SCRATCHLM, "scratchlm_alone", "ids.pt", "out.pt"],
                   check=True, cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    result = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        torch.testing.assert_close(result["logits"], model(ids), rtol=1e-5, atol=1e-5)
    ours = generate(model, ids[:, :4].tolist(), 8, temperature=0)
    assert result["tokens"][:, 4:].tolist() == ours


TRANSFORMERS4_PYTHON = os.environ.get("SCRATCHLM_TRANSFORMERS4_PYTHON")
LOAD_IN_TRANSFORMERS4 = """
import sys, torch, transformers
assert transformers.__version__.startswith("4."), transformers.__version__
inputs = torch.load(sys.argv[1])
results = {}
for case, folder in inputs["folders"].items():
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = model(inputs["ids"]).logits
        padded = model(inputs["ids"], attention_mask=inputs["mask"]).logits
        tokens = model.generate(inputs["ids"][:, :8], attention_mask=inputs["mask"][:, :8], max_new_tokens=16,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    results[case] = {"logits": logits, "padded": padded, "tokens": tokens[:, 8:]}
torch.save({"results": results, "version": transformers.__version__}, sys.argv[2])
"""


@pytest.mark.skipif(not TRANSFORMERS4_PYTHON, reason="needs SCRATCHLM_TRANSFORMERS4_PYTHON, a Python with "
                    "transformers 4.x and torch (scripts/test_transformers_versions.sh sets it)")
def test_transformers_4_loads_the_folders_with_equal_logits_and_generation(tokenizer, tmp_path):
    """Exported here (the pinned transformers), loaded by transformers 4.x in its own Python, compared here."""
    ids = torch.randint(0, tokenizer.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # row 1: a prompt of 5 tokens after 3 of left padding
    models = {case: random_model(tokenizer, **overrides) for case, overrides in CASES.items()}
    folders = {case: str(tmp_path / f"scratchlm_{case}") for case in CASES}
    for case, model in models.items():
        export_custom_code(model, tokenizer, tmp_path / f"scratchlm_{case}")
    torch.save({"folders": folders, "ids": ids, "mask": mask}, tmp_path / "inputs.pt")
    subprocess.run([TRANSFORMERS4_PYTHON, "-c", LOAD_IN_TRANSFORMERS4, "inputs.pt", "out.pt"], check=True,
                   cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""})
    loaded = torch.load(tmp_path / "out.pt")
    real = mask.bool()
    prompts = [ids[0, :8].tolist(), ids[1, 3:8].tolist()]
    for case, model in models.items():
        theirs = loaded["results"][case]
        named = {"rtol": 1e-5, "atol": 1e-5, "msg": lambda text, case=case: f"{case}: {text}"}
        with torch.no_grad():
            torch.testing.assert_close(theirs["logits"], model(ids), **named)
            torch.testing.assert_close(theirs["padded"][real], model(ids, attention_mask=real)[real], **named)
        assert theirs["tokens"].tolist() == generate(model, prompts, 16, temperature=0), \
            f"{case}: transformers {loaded['version']} generated other tokens"


def test_tokenizer_larger_than_the_model_is_refused(tokenizer, tmp_path):
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size - 1, ffn="relu2"))
    with pytest.raises(ValueError, match=f"tokenizer has {tokenizer.vocab_size} ids but the model only"):
        export_hf(model, tokenizer, tmp_path / "out")  # a custom-code model: export_hf checks before choosing
    assert not (tmp_path / "out").exists()
