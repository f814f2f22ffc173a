"""`scratchlm export hf` / `import hf`: transformers' Auto classes load our export offline with equal logits and ids."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.testing import assert_close

from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.compat.hf_import import read_hf_tokenizer
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.hf import UnsupportedHFTokenizer, write_hf_tokenizer
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.checkpoint import load_for_inference

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Once upon a time, there was a little cat named Tom.",
    "Lily said: \"I don't know!\"<|endoftext|>Then Ben ran  away   quickly.\n\n",
    "<|endoftext|><|endoftext|>",
    "naïve café – “quotes” 🐱🐶 日本語 \t tabs\r\nand 123456 numbers'll've",
    " leading space and trailing spaces   ",
    "",
]
CORPUS = ("Once upon a time there was a little girl named Lily. She liked to play with her cat Tom. "
          "One day, Tom ran away and Lily was sad. Ben said: \"Don't worry, we'll find him!\" ") * 30

pytestmark = pytest.mark.usefixtures("hf_offline_one_thread")


@pytest.fixture(scope="module")
def trained_tokenizer(tmp_path_factory) -> Tokenizer:
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(f"{CORPUS}<|endoftext|>naïve café 🐱 日本語\n", encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def _run_dir(tmp_path, tokenizer: Tokenizer, **model_overrides) -> tuple[TransformerLM, object]:
    torch.manual_seed(0)
    cfg = ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, **model_overrides)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():  # non-trivial norm gains, so a mapping mistake in them would show
        for name, param in model.named_parameters():
            if name.endswith(("ln1.weight", "ln2.weight", "ln_final.weight")):
                param.uniform_(0.5, 1.5)
    run = tmp_path / "run"
    write_run(model, tokenizer, run)
    return model, run


def _export(run, out) -> None:
    assert main(["export", "hf", "--checkpoint", str(run), "--out", str(out)]) == 0


@pytest.mark.parametrize(("switches", "class_name"), [
    ({}, "LlamaForCausalLM"),
    (dict(tie_embeddings=True), "LlamaForCausalLM"),
    (dict(num_kv_heads=2, rope_theta=500_000.0, rope_scaling="llama3", rope_original_context=8), "LlamaForCausalLM"),
    (dict(qkv_bias=True, num_kv_heads=1), "Qwen2ForCausalLM"),
    (dict(qk_norm=True, num_kv_heads=2, head_dim=32, tie_embeddings=True), "Qwen3ForCausalLM"),
])
def test_auto_model_loads_export_offline_with_equal_logits(tmp_path, trained_tokenizer, capsys, switches,
                                                            class_name):
    model, run = _run_dir(tmp_path, trained_tokenizer, **switches)
    out = tmp_path / "hf"
    capsys.readouterr()
    _export(run, out)
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"architecture {class_name}: ")  # which one, and why
    assert printed[1] == f"wrote {out}/: config.json, model.safetensors, tokenizer.json, tokenizer_config.json"
    assert not list(out.glob("*.bin"))  # no pickle
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf).__name__ == class_name
    ids = torch.randint(0, trained_tokenizer.vocab_size, (3, 32))
    with torch.inference_mode():
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=1e-4, atol=1e-4)


def test_auto_tokenizer_ids_equal_ours(tmp_path, trained_tokenizer):
    _, run = _run_dir(tmp_path, trained_tokenizer)
    _export(run, tmp_path / "hf")
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert hf.eos_token == "<|endoftext|>"
    assert hf.eos_token_id == trained_tokenizer.special_id("<|endoftext|>")
    for text in TEXTS:
        ours = trained_tokenizer.encode(text)
        assert hf(text, add_special_tokens=False)["input_ids"] == ours, text
        assert hf.decode(ours) == trained_tokenizer.decode(ours)
    saved = trained_tokenizer.save(tmp_path / "saved")  # one writer: save and export write the same files
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (saved / name).read_bytes()


def test_gpt2_tokenizer_export_equals_ours(tmp_path, gpt2_files):
    vocab_path, merges_path = gpt2_files
    tokenizer = Tokenizer.from_files(vocab_path, merges_path, ["<|endoftext|>"])
    (tmp_path / "hf").mkdir()
    write_hf_tokenizer(tmp_path / "hf", tokenizer)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    for text in TEXTS:
        assert hf(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text), text


def test_import_of_export_round_trips_weights_and_tokenizer(tmp_path, trained_tokenizer):
    model, run = _run_dir(tmp_path, trained_tokenizer)
    _export(run, tmp_path / "hf")
    assert main(["import", "hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    loaded, config = load_for_inference(tmp_path / "imported")
    assert loaded.config == model.config
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor, rtol=0, atol=0)
    assert Tokenizer.load(config.data.tokenizer).hash == trained_tokenizer.hash
    assert (tmp_path / "imported" / "config.toml").is_file()


def test_import_of_a_transformers_llama(tmp_path, trained_tokenizer):
    """A Llama saved by transformers itself (not by our export) imports with equal logits."""
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=48,
                                      rope_theta=500.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", "--model", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    ours, _ = load_for_inference(tmp_path / "run")
    ids = torch.randint(0, 300, (2, 48))
    with torch.inference_mode():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def _exported(tmp_path, trained_tokenizer):
    _, run = _run_dir(tmp_path, trained_tokenizer)
    _export(run, tmp_path / "hf")
    return tmp_path / "hf"


def test_import_refuses_pickle_weights(tmp_path, trained_tokenizer, capsys):
    folder = _exported(tmp_path, trained_tokenizer)
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run2")]) == 1
    assert "no model.safetensors" in capsys.readouterr().err


def test_import_reads_sharded_safetensors(tmp_path, trained_tokenizer):
    folder = _exported(tmp_path, trained_tokenizer)
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for shard, part in (("a.safetensors", names[::2]), ("b.safetensors", names[1::2])):
        save_file({n: tensors[n] for n in part}, folder / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run2")]) == 0


@pytest.mark.parametrize(("switches", "why"), [
    (dict(ffn="relu2", d_ff=128), "ffn='relu2'"),
    (dict(norm_position="post"), "norm_position='post'"),
    (dict(logit_softcap=30.0), "logit_softcap=30.0"),
    (dict(qk_norm=True, qkv_bias=True), "qk_norm=True with qkv_bias=True"),
])
def test_export_hands_what_no_standard_architecture_expresses_to_custom_code(tmp_path, trained_tokenizer, capsys,
                                                                             switches, why):
    """Through the CLI: the reason is printed and the custom-code folder (compat/hf_custom_code.py, whose own tests
    cover every switch) loads with trust_remote_code and our logits."""
    model, run = _run_dir(tmp_path, trained_tokenizer, **switches)
    capsys.readouterr()
    _export(run, tmp_path / "hf")
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("architecture custom code (trust_remote_code=True): no standard architecture: ")
    assert why in first
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "scratchlm"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True,
                                                           local_files_only=True).eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    with torch.no_grad():
        assert_close(hf(ids).logits, model.eval()(ids), rtol=1e-5, atol=1e-5)


def test_export_of_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 1
    assert "nope" in capsys.readouterr().err


def test_tokenizer_without_bytelevel_bpe_is_left_out_saying_why(tmp_path, trained_tokenizer, capsys):
    assert read_hf_tokenizer(tmp_path) is None  # no tokenizer.json at all
    folder = _exported(tmp_path, trained_tokenizer)
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordPiece"}, "pre_tokenizer": None}))
    with pytest.raises(UnsupportedHFTokenizer, match="model 'WordPiece'"):
        read_hf_tokenizer(folder)
    capsys.readouterr()
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run2")]) == 0
    out = capsys.readouterr().out
    assert "tokenizer left out" in out and "model 'WordPiece'" in out and "pass --tokenizer to generate" in out
    assert not (tmp_path / "run2" / "tokenizer").exists()


@pytest.mark.parametrize("scaling", ["none", "llama3"])
def test_exported_config_gives_rope_to_transformers_4_and_5(tmp_path, scaling):
    """4.x reads rope_theta + rope_scaling, 5.x rope_parameters: both spellings carry θ and the llama3 numbers, and
    agree (import refuses a config whose spellings differ); the installed version loads them."""
    from scratchlm.compat.hf import rope_spellings
    from scratchlm.compat.hf_export import export_hf

    cfg = ModelConfig(vocab_size=300, context_length=32, d_model=64, num_layers=1, num_heads=4, d_ff=96,
                      rope_theta=500_000.0, rope_scaling=scaling, rope_scaling_factor=32.0, rope_original_context=16)
    vocab = {i: bytes([i]) for i in range(256)}
    export_hf(TransformerLM(cfg), Tokenizer(vocab, [], ["<|endoftext|>"]), tmp_path / "hf")
    document = json.loads((tmp_path / "hf" / "config.json").read_text())
    llama3 = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    expected = {"rope_type": "default"} if scaling == "none" else {"rope_type": "llama3", **llama3}
    assert document["rope_theta"] == 500_000.0
    assert document["rope_scaling"] == (None if scaling == "none" else expected)
    assert document["rope_parameters"] == {**expected, "rope_theta": 500_000.0}
    five, four = rope_spellings(document)
    assert five == four == {**expected, "rope_theta": 500_000.0}
    loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert loaded.rope_parameters == {**expected, "rope_theta": 500_000.0}
    old_style = {"rope_theta": 123.0, "rope_scaling": {"type": "llama3", **llama3}}  # "type": an older 4.x key
    assert rope_spellings(old_style) == [{"rope_type": "llama3", "rope_theta": 123.0, **llama3}]
    assert rope_spellings({}) == []
