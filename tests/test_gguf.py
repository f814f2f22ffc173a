"""`scratchlm export gguf` / `import gguf`: the file holds what llama.cpp reads (checked with the `gguf` package's
own reader and quantiser), and importing an export gives back the model (equal logits for f32, within a stated
tolerance for f16 and q8_0) and the tokenizer. llama.cpp itself runs the exports in test_gguf_llama_cpp.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch.testing import assert_close

from scratchlm.cli import main
from scratchlm.compat.commands import write_run
from scratchlm.compat.gguf_export import GGUF_TYPES, export_gguf
from scratchlm.compat.gguf_import import read_gguf
from scratchlm.compat.hf import to_hf_state_dict
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.io import to_gpt2_string
from scratchlm.tokenizer.pipeline import Pipeline
from scratchlm.tokenizer.pretokenize import GPT4_SPLIT_PATTERN, LLAMA3_SPLIT_PATTERN
from scratchlm.tokenizer.train_bpe import train_bpe
from scratchlm.train.checkpoint import load_for_inference

gguf = pytest.importorskip("gguf", reason="the [gguf] extra is not installed")

CORPUS = ("Once upon a time there was a little girl named Lily. She liked to play with her cat Tom. "
          "One day, Tom ran away and Lily was sad. Ben said: \"Don't worry, we'll find him!\" ") * 30
TEXT = "Once upon a time, Lily's cat Tom<|endoftext|>naïve café 🐱 ran  away!"
# The model shapes each architecture is written for: a plain Llama, Llama with grouped-query attention, tied
# embeddings and Llama 3's RoPE scaling, Qwen2's q/k/v biases, and a Qwen3-shaped modern recipe (QK-norm, tied,
# an explicit head_dim, multi-query).
SHAPES = {
    "llama": dict(),
    "llama-gqa-tied-llama3": dict(num_kv_heads=2, tie_embeddings=True, rope_theta=500_000.0, rope_scaling="llama3",
                                  rope_original_context=64),
    "qwen2": dict(qkv_bias=True, num_kv_heads=2),
    "qwen3": dict(qk_norm=True, tie_embeddings=True, head_dim=32, num_kv_heads=1),
}
ARCH = {"llama": "llama", "llama-gqa-tied-llama3": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Largest |logit difference| allowed after a round trip through each type, for these tiny models (logits of order
# 1; measured ~2e-3 for f16, ~0.09 for q8_0): f16 keeps 11 significant bits per weight, q8_0 ~8 (a scale per 32
# weights). That q8_0 is exactly ggml's rounding is test_q8_0_weights_are_llama_cpps_quantisation's job.
TOLERANCE = {"f32": 0.0, "f16": 1e-2, "q8_0": 0.2}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    corpus = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    corpus.write_text(f"{CORPUS}<|endoftext|>naïve café 🐱 日本語\n", encoding="utf-8")
    vocab, merges = train_bpe(corpus, 300, ["<|endoftext|>"])
    return Tokenizer(vocab, merges, ["<|endoftext|>"])


def tiny_run(tmp_path, tokenizer: Tokenizer, **switches) -> tuple[TransformerLM, object]:
    """A run directory holding a random tiny model with these switches (vocab padded past the tokenizer's)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size + 5, context_length=64,
                                                   **switches)).eval()
    with torch.no_grad():  # non-trivial gains and biases, so a mapping mistake in them would show
        for name, param in model.named_parameters():
            if param.ndim == 1:
                param.uniform_(0.5, 1.5) if name.endswith("weight") else param.normal_()
    run = tmp_path / "run"
    write_run(model, tokenizer, run)
    return model, run


def export(run, out, *extra: str) -> None:
    assert main(["export", "gguf", "--checkpoint", str(run), "--out", str(out), *extra]) == 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gguf_type", GGUF_TYPES)
def test_import_of_export_gives_the_model_back(tmp_path, tokenizer, capsys, shape, gguf_type):
    model, run = tiny_run(tmp_path, tokenizer, **SHAPES[shape])
    export(run, tmp_path / "m.gguf", "--type", gguf_type)
    assert f"architecture {ARCH[shape]} (" in capsys.readouterr().out
    assert main(["import", "gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "back")]) == 0
    back, config = load_for_inference(tmp_path / "back")
    assert config.model == model.config  # every switch, the llama3 numbers and norm_eps (a float32 in GGUF) too
    ids = torch.tensor([tokenizer.encode(TEXT)])
    with torch.no_grad():
        expected, got = model(ids), back(ids)
    if gguf_type == "f32":
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), back.state_dict().values()))
        assert torch.equal(got, expected)
    else:
        assert (got - expected).abs().max() <= TOLERANCE[gguf_type]
    imported = Tokenizer.load(tmp_path / "back" / "tokenizer")
    assert imported.hash == tokenizer.hash
    assert imported.encode(TEXT) == tokenizer.encode(TEXT)


def test_q8_0_weights_are_llama_cpps_quantisation(tmp_path, tokenizer):
    """Each imported 2-D weight is exactly ggml's q8_0 round trip of ours (the gguf package's port of ggml's
    quantize_row_q8_0 / dequantize); 1-D ones are exact."""
    model, run = tiny_run(tmp_path, tokenizer)
    export(run, tmp_path / "m.gguf", "--type", "q8_0")
    assert main(["import", "gguf", str(tmp_path / "m.gguf"), "--out", str(tmp_path / "back")]) == 0
    back, _ = load_for_inference(tmp_path / "back")
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for (name, ours), theirs in zip(model.state_dict().items(), back.state_dict().values()):
        if ours.ndim == 2:
            expected = gguf.quants.dequantize(gguf.quants.quantize(ours.numpy(), q8_0), q8_0)
            assert np.array_equal(theirs.numpy(), expected), name
            assert not torch.equal(theirs, ours), name  # it really was quantised
        else:
            assert torch.equal(theirs, ours), name


@pytest.mark.parametrize("gguf_type, matrix_type", [("f32", "F32"), ("f16", "F16"), ("q8_0", "Q8_0")])
def test_metadata_and_tensors_are_what_llama_cpp_reads(tmp_path, tokenizer, gguf_type, matrix_type):
    model, run = tiny_run(tmp_path, tokenizer, **SHAPES["llama-gqa-tied-llama3"])
    export(run, tmp_path / "m.gguf", "--type", gguf_type)
    reader = gguf.GGUFReader(tmp_path / "m.gguf")
    field = {key: value.contents() for key, value in reader.fields.items()}
    cfg = model.config
    assert field["general.architecture"] == "llama"
    assert field["general.name"] == "run"
    assert field["scratchlm.version"]
    assert field["general.file_type"] == {"f32": 0, "f16": 1, "q8_0": 7}[gguf_type]
    assert (field["llama.block_count"], field["llama.embedding_length"], field["llama.feed_forward_length"],
            field["llama.attention.head_count"], field["llama.attention.head_count_kv"],
            field["llama.context_length"], field["llama.rope.dimension_count"]) == (
        cfg.num_layers, cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.num_kv_heads, cfg.context_length, cfg.head_dim)
    assert field["llama.rope.freq_base"] == 500_000.0
    assert field["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.norm_eps)
    # The tokenizer: GPT-2 spelling, the special token a control token, the padding ids unused, no BOS added.
    assert (field["tokenizer.ggml.model"], field["tokenizer.ggml.pre"]) == ("gpt2", "gpt-2")
    tokens, types = field["tokenizer.ggml.tokens"], field["tokenizer.ggml.token_type"]
    assert len(tokens) == len(types) == cfg.vocab_size
    eot = tokenizer.special_id("<|endoftext|>")
    assert (tokens[eot], types[eot]) == ("<|endoftext|>", gguf.TokenType.CONTROL)
    assert tokens[tokenizer.encode(" Lily")[0]] == to_gpt2_string(b" Lily") == "ĠLily"
    assert types[-5:] == [gguf.TokenType.UNUSED] * 5
    assert field["tokenizer.ggml.merges"][0] == " ".join(map(to_gpt2_string, tokenizer.merges[0]))
    assert len(field["tokenizer.ggml.merges"]) == len(tokenizer.merges)
    assert field["tokenizer.ggml.bos_token_id"] == field["tokenizer.ggml.eos_token_id"] == eot
    assert field["tokenizer.ggml.add_bos_token"] is False
    # Tensors: llama.cpp's names, tied (no output.weight), 1-D ones f32, matrices in the type asked for.
    tensors = {t.name: t for t in reader.tensors}
    assert "output.weight" not in tensors and "token_embd.weight" in tensors
    assert {t.tensor_type.name for name, t in tensors.items() if len(t.shape) == 1} == {"F32"}
    assert {t.tensor_type.name for t in tensors.values() if len(t.shape) == 2} == {matrix_type}
    assert list(tensors["blk.0.attn_k.weight"].shape) == [cfg.d_model, cfg.num_kv_heads * cfg.head_dim]
    # rope_freqs as llama.cpp's converter computes it from Llama 3's four numbers (written out independently).
    factors = []
    for i in range(cfg.head_dim // 2):
        wavelength = 2 * math.pi * cfg.rope_theta ** (2 * i / cfg.head_dim)
        low, high = cfg.rope_original_context / cfg.rope_low_freq_factor, cfg.rope_original_context / 4.0
        if wavelength < high:
            factors.append(1.0)
        elif wavelength > low:
            factors.append(cfg.rope_scaling_factor)
        else:
            smooth = (cfg.rope_original_context / wavelength - 1.0) / (4.0 - 1.0)
            factors.append(1 / ((1 - smooth) / cfg.rope_scaling_factor + smooth))
    assert_close(torch.from_numpy(np.array(tensors["rope_freqs.weight"].data)), torch.tensor(factors), rtol=1e-5,
                 atol=0)
    assert len(set(factors)) > 2  # the smooth band is exercised, not only the two ends


@pytest.mark.parametrize("shape", ["llama", "qwen2"])
def test_q_k_rows_follow_llama_cpps_rope_for_each_architecture(tmp_path, tokenizer, shape):
    """llama.cpp's llama rotates adjacent pairs as we do (our rows as they are); its qwen2/qwen3 rotate halves as
    Hugging Face does (compat/hf.py's permuted rows, biases permuted alike)."""
    model, run = tiny_run(tmp_path, tokenizer, **SHAPES[shape])
    export(run, tmp_path / "m.gguf")
    tensors = {t.name: np.array(t.data) for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    ours = model.state_dict()
    hf = to_hf_state_dict(ours, model.config)
    expected = ours["layers.1.attn.k_proj.weight"] if shape == "llama" else hf["model.layers.1.self_attn.k_proj.weight"]
    assert np.array_equal(tensors["blk.1.attn_k.weight"], expected.numpy())
    assert not torch.equal(ours["layers.1.attn.k_proj.weight"], hf["model.layers.1.self_attn.k_proj.weight"])
    if shape == "qwen2":
        assert np.array_equal(tensors["blk.1.attn_k.bias"], hf["model.layers.1.self_attn.k_proj.bias"].numpy())


def test_chat_template_and_end_of_turn_go_out_and_come_back(tmp_path, tokenizer):
    template = "{% for m in messages %}{{ m.content }}<|endoftext|>{% endfor %}"
    chat = tokenizer.with_chat_template(template, end_of_turn=["<|endoftext|>"])
    model, _ = tiny_run(tmp_path, chat)
    export_gguf(model, chat, tmp_path / "m.gguf", name="templated")
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields
    assert fields["tokenizer.chat_template"].contents() == template
    assert fields["tokenizer.ggml.eot_token_id"].contents() == chat.special_id("<|endoftext|>")
    _, back, _ = read_gguf(tmp_path / "m.gguf", max_gib=1.0)
    assert back.chat_template.source == template and back.end_of_turn_ids == chat.end_of_turn_ids
    export_gguf(model, tokenizer, tmp_path / "plain.gguf", name="plain")
    assert "tokenizer.chat_template" not in gguf.GGUFReader(tmp_path / "plain.gguf").fields


def test_split_patterns_map_to_llama_cpps_names(tmp_path, tokenizer):
    """Llama 3's pattern is llama.cpp's llama-bpe, which ignores merges: a tokenizer that applies them is written
    when that changes no id, and refused, naming a token, when it would."""
    model, _ = tiny_run(tmp_path, tokenizer)
    llama3 = Tokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens,
                       pipeline=Pipeline(LLAMA3_SPLIT_PATTERN, ignore_merges=True))
    export_gguf(model, llama3, tmp_path / "l3.gguf", name="l3")
    assert gguf.GGUFReader(tmp_path / "l3.gguf").fields["tokenizer.ggml.pre"].contents() == "llama-bpe"
    # A vocab where "abc" is a token but BPE of b"abc" gives "a" + "bc": merges matter for that pre-token.
    vocab = {i: bytes([i]) for i in range(256)} | {256: b"ab", 257: b"bc", 258: b"abc"}
    merges = [(b"b", b"c"), (b"a", b"b"), (b"ab", b"c")]
    applies = Tokenizer(vocab, merges, [], pipeline=Pipeline(LLAMA3_SPLIT_PATTERN))
    small = TransformerLM(ModelConfig.preset("tiny", vocab_size=259))
    with pytest.raises(ValueError, match=r"ignore_merges=False, but llama.cpp's 'llama-bpe' ignores merges, and "
                                         r"token b'abc' would encode differently"):
        export_gguf(small, applies, tmp_path / "no.gguf", name="no")
    gpt4 = Tokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens,
                     pipeline=Pipeline(GPT4_SPLIT_PATTERN))
    with pytest.raises(ValueError, match="is not one llama.cpp knows"):
        export_gguf(model, gpt4, tmp_path / "no.gguf", name="no")
    assert not list(tmp_path.glob("no.gguf*")) and not list(tmp_path.glob(".no.gguf*"))


@pytest.mark.parametrize("switches, message", [
    (dict(ffn="relu2"), "llama.cpp cannot run this model: ffn='relu2'"),
    (dict(logit_softcap=30.0), "llama.cpp cannot run this model: logit_softcap=30.0"),
    (dict(norm_position="post"), "llama.cpp cannot run this model: norm_position='post'"),
    (dict(norm="none"), "llama.cpp cannot run this model: norm='none'"),
    (dict(position="nope"), "llama.cpp cannot run this model: position='nope'"),
    (dict(qk_norm=True, qkv_bias=True), "llama.cpp cannot run this model: qk_norm=True with qkv_bias=True"),
    (dict(qk_norm=True, rope_scaling="llama3"), "rope_scaling='llama3' with qwen3's layout"),
])
def test_what_llama_cpp_cannot_run_is_refused_in_one_line_before_writing(tmp_path, tokenizer, capsys, switches,
                                                                         message):
    _, run = tiny_run(tmp_path, tokenizer, **switches)
    capsys.readouterr()
    assert main(["export", "gguf", "--checkpoint", str(run), "--out", str(tmp_path / "out" / "m.gguf")]) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and message in error, error
    assert not (tmp_path / "out").exists()


def test_existing_file_is_replaced_only_with_force(tmp_path, tokenizer, capsys):
    _, run = tiny_run(tmp_path, tokenizer)
    (tmp_path / "m.gguf").write_bytes(b"mine")
    assert main(["export", "gguf", "--checkpoint", str(run), "--out", str(tmp_path / "m.gguf")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "m.gguf").read_bytes() == b"mine"
    export(run, tmp_path / "m.gguf", "--force")
    assert (tmp_path / "m.gguf").read_bytes()[:4] == b"GGUF"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "run"]  # no temporary file left


def test_import_refuses_what_it_cannot_run_naming_the_key(tmp_path, tokenizer, capsys):
    """A GGUF file from elsewhere: another architecture, or a hyperparameter our model has no switch for."""
    model, run = tiny_run(tmp_path, tokenizer)
    for name, arch, extra in (("gemma.gguf", "gemma", {}), ("window.gguf", "llama",
                                                          {"llama.attention.sliding_window": 8})):
        writer = gguf.GGUFWriter(tmp_path / name, arch)
        writer.add_uint32(f"{arch}.block_count", 2)
        for key, value in extra.items():
            writer.add_uint32(key, value)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    capsys.readouterr()
    assert main(["import", "gguf", str(tmp_path / "gemma.gguf"), "--out", str(tmp_path / "a")]) == 1
    assert "general.architecture='gemma' is not one we read" in capsys.readouterr().err
    assert main(["import", "gguf", str(tmp_path / "window.gguf"), "--out", str(tmp_path / "b")]) == 1
    assert "llama.attention.sliding_window=8" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_file_without_our_keys_is_read_as_llama_cpp_runs_it(tmp_path, tokenizer, monkeypatch):
    """Our scratchlm.* keys make the round trip exact; a file from elsewhere has none: Llama 3's RoPE scaling is
    read from rope_freqs under Llama 3.1's rule, merges are ignored for llama-bpe and nothing is put in NFC."""
    import scratchlm.compat.gguf_export as gguf_export
    from scratchlm.tokenizer.pretokenize import QWEN2_SPLIT_PATTERN

    torch.manual_seed(0)
    model = TransformerLM(ModelConfig.preset("tiny", vocab_size=tokenizer.vocab_size, rope_scaling="llama3",
                                             rope_scaling_factor=32.0)).eval()
    llama3 = Tokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens,
                       pipeline=Pipeline(LLAMA3_SPLIT_PATTERN))  # merges applied: no token depends on it here
    for key in ("KEY_LLAMA3", "KEY_NFC", "KEY_IGNORE_MERGES"):
        monkeypatch.setattr(gguf_export, key, f"elsewhere.{key.lower()}")
    export_gguf(model, llama3, tmp_path / "m.gguf", name="foreign")
    back, imported, _ = read_gguf(tmp_path / "m.gguf", max_gib=1.0)  # its keys were bound before the patch
    assert (back.config.rope_scaling, back.config.rope_scaling_factor) == ("llama3", 32.0)
    assert back.config == model.config
    assert imported.pipeline == Pipeline(LLAMA3_SPLIT_PATTERN, ignore_merges=True)  # llama.cpp's llama-bpe
    assert imported.encode(TEXT) == llama3.encode(TEXT)

    monkeypatch.undo()
    qwen2 = Tokenizer(tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens,
                      pipeline=Pipeline(QWEN2_SPLIT_PATTERN, nfc=True))
    plan = export_gguf(model, qwen2, tmp_path / "q.gguf", name="nfc")
    assert plan.pre == "qwen2" and "does not put text in NFC" in plan.notes[0]
    assert main(["import", "gguf", str(tmp_path / "q.gguf"), "--out", str(tmp_path / "back_q")]) == 0
    assert Tokenizer.load(tmp_path / "back_q" / "tokenizer").hash == qwen2.hash  # our key keeps the NFC


def test_bf16_tensors_are_read(tmp_path, tokenizer, monkeypatch):
    """Files from elsewhere often hold bf16 (llama.cpp's converter writes it with --outtype bf16): each weight comes
    back as the bf16 value of ours, as torch rounds it."""
    import scratchlm.compat.gguf_export as gguf_export

    bf16 = gguf.GGMLQuantizationType.BF16
    monkeypatch.setattr(gguf_export, "_encoded", lambda array, _: (
        (gguf.quants.quantize(array, bf16), bf16) if array.ndim == 2 else (array, gguf.GGMLQuantizationType.F32)))
    model, _ = tiny_run(tmp_path, tokenizer, qk_norm=True)
    export_gguf(model, tokenizer, tmp_path / "m.gguf", name="bf16")
    assert {t.tensor_type for t in gguf.GGUFReader(tmp_path / "m.gguf").tensors if len(t.shape) == 2} == {bf16}
    back, _, _ = read_gguf(tmp_path / "m.gguf", max_gib=1.0)
    for (name, ours), theirs in zip(model.state_dict().items(), back.state_dict().values()):
        expected = ours.bfloat16().float() if ours.ndim == 2 else ours
        assert torch.equal(theirs, expected), name
