"""`scratchlm import hf` of folders transformers itself saved, and `export hf` back to transformers.

Each architecture round-trips through the CLI: a random tiny HF model (real checkpoints' head layouts, see
hf_models.py) saved with `save_pretrained` -> `import hf` -> greedy decoding of the run equals HF's `generate`
-> `export hf` (which says the architecture it chose) -> `AutoModelForCausalLM` loads it with the logits of the
original. Sharded folders and bf16/fp16 weights import too (`--dtype` builds the model in that dtype), and every
config we cannot run exactly is refused in one line naming the field and its value, leaving no files behind.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from torch.testing import assert_close

from hf_models import COMMON, hf_config, hf_model
from scratchlm.cli import main
from scratchlm.compat.hf import from_hf_state_dict
from scratchlm.compat.hf_import import read_hf_folder, read_hf_model
from scratchlm.compat.safetensors_header import read_safetensors_header
from scratchlm.generate.decoding import generate
from scratchlm.tokenizer import Tokenizer
from scratchlm.tokenizer.formats.hf import write_hf_tokenizer
from scratchlm.train.checkpoint import load_for_inference

transformers = pytest.importorskip("transformers")

CLOSE = dict(rtol=1e-5, atol=1e-5)
TOKENIZER = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])  # 257 ids < COMMON's 300

pytestmark = pytest.mark.usefixtures("hf_offline_one_thread")


def _saved(folder, name: str, dtype: torch.dtype = torch.float32, **save_options):
    """(the HF model with the weights as saved, loaded back in float32) and its folder with our tokenizer beside it.
    Loaded back, not widened in place: `.to(bfloat16)` would have rounded its RoPE frequencies too."""
    hf_model(hf_config(name)).to(dtype).save_pretrained(folder, **save_options)
    write_hf_tokenizer(folder, TOKENIZER)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager",
                                                           local_files_only=True)
    return hf.eval(), folder


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize(("name", "exported_as"), [
    ("smollm2-135m", "LlamaForCausalLM"),
    ("llama-3.2-1b", "LlamaForCausalLM"),
    ("qwen2.5", "Qwen2ForCausalLM"),
    ("qwen3-0.6b", "Qwen3ForCausalLM"),
    ("mistral", "LlamaForCausalLM"),  # a Mistral without a sliding window is a Llama
])
def test_round_trip_import_generate_export_reload(tmp_path, capsys, name, exported_as):
    hf, folder = _saved(tmp_path / "hf", name)
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 0
    ours, config = load_for_inference(tmp_path / "run")
    assert Tokenizer.load(config.data.tokenizer).hash == TOKENIZER.hash

    prompt = [72, 101, 108, 108, 111]
    with torch.no_grad():
        theirs = hf.generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                             pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 16, temperature=0.0) == [theirs]

    capsys.readouterr()
    assert main(["export", "hf", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"architecture {exported_as}: "), printed
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [exported_as]
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", local_files_only=True).eval()
    assert type(back).__name__ == exported_as
    ids = torch.randint(0, COMMON["vocab_size"], (2, COMMON["max_position_embeddings"]))
    assert_close(_logits(back, ids), _logits(hf, ids), **CLOSE)


def test_sharded_folder_imports(tmp_path):
    hf, folder = _saved(tmp_path / "hf", "qwen3-0.6b", max_shard_size="100KB")
    shards = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values()
    assert len(set(shards)) > 1 and not (folder / "model.safetensors").exists()
    ids = torch.randint(0, COMMON["vocab_size"], (2, 40))
    assert_close(_logits(read_hf_model(folder), ids), _logits(hf, ids), **CLOSE)


@pytest.mark.parametrize(("saved", "built"), [
    (torch.bfloat16, torch.float32), (torch.float16, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
])
def test_half_precision_weights_and_dtype(tmp_path, saved, built):
    """bf16/fp16 weights widen to float32 exactly (the logits of HF's model, widened); --dtype builds the model in
    the dtype asked for, its weights HF's rounded to it, and the run's checkpoint stores them so."""
    hf, folder = _saved(tmp_path / "hf", "qwen2.5", dtype=saved)
    ours = read_hf_model(folder, dtype=built)
    assert {p.dtype for p in ours.parameters()} == {built}
    if built == torch.float32:
        ids = torch.randint(0, COMMON["vocab_size"], (2, 40))
        assert_close(_logits(ours, ids), _logits(hf, ids), **CLOSE)
    expected = from_hf_state_dict({n: t.to(saved).to(built) for n, t in hf.state_dict().items()}, ours.config)
    for tensor_name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, expected[tensor_name]), tensor_name
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[built]
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run"), "--dtype", name]) == 0
    header = read_safetensors_header(next((tmp_path / "run").rglob("model.safetensors")))
    assert {entry.dtype for entry in header.values()} == {{"fp32": "F32", "bf16": "BF16", "fp16": "F16"}[name]}


def test_read_hf_folder_gives_model_and_tokenizer_without_writing(tmp_path):
    _, folder = _saved(tmp_path / "hf", "smollm2-135m")
    before = sorted(p.name for p in folder.iterdir())
    model, tokenizer, missing = read_hf_folder(folder)
    assert model.config.num_kv_heads == 3 and tokenizer.hash == TOKENIZER.hash and missing is None
    (folder / "tokenizer.json").unlink()
    assert read_hf_folder(folder)[1:] == (None, f"no tokenizer.json in {folder}")
    assert sorted(p.name for p in folder.iterdir()) == [n for n in before if n != "tokenizer.json"]


def _edit(folder, changes: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))


_DROP = object()
_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}

REFUSED = [  # (folder saved from, config.json changes, the field and value the one-line error names)
    ("smollm2-135m", {"model_type": "gpt2"}, "model_type='gpt2' is not one we read"),
    ("smollm2-135m", {"model_type": "gemma2"}, "model_type='gemma2'"),
    ("smollm2-135m", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3-0.6b", {"attention_bias": True}, "attention_bias=True"),
    ("smollm2-135m", {"mlp_bias": True}, "mlp_bias=True"),
    ("qwen2.5", {"hidden_act": "gelu_pytorch_tanh"}, "hidden_act='gelu_pytorch_tanh'"),
    ("smollm2-135m", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e5}},
     "rope_type='linear'"),
    ("qwen2.5", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6}},
     "rope_type='dynamic'"),
    # transformers 4.x's spelling: rope_theta + rope_scaling (whose type key was once "type").
    ("qwen2.5", {"rope_parameters": _DROP, "rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                                               "original_max_position_embeddings": 16}},
     "rope_type='yarn'"),
    ("llama-3.2-1b", {"rope_parameters": {**_LLAMA3, "rope_theta": 5e5}, "rope_theta": 1e4, "rope_scaling": None},
     "disagrees with rope_theta/rope_scaling"),
    ("mistral", {"sliding_window": 16}, "sliding_window=16 is shorter than max_position_embeddings=64"),
    ("qwen2.5", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1, "layer_types": _DROP},
     "sliding_window=32 on its 'sliding_attention' layer_types"),
    ("qwen3-0.6b", {"use_sliding_window": True, "sliding_window": 8,
                    "layer_types": ["sliding_attention", "full_attention"]}, "sliding_window=8"),
    ("qwen3-0.6b", {"layer_types": ["chunked_attention", "full_attention"]}, "layer_types has 'chunked_attention'"),
    ("smollm2-135m", {"quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}},
     "quantization_config="),
    ("smollm2-135m", {"num_key_value_heads": 2}, "model.num_kv_heads (2) must divide model.num_heads (9)"),
    ("qwen3-0.6b", {"num_hidden_layers": 10**12}, "over the --max-gib limit"),
]


@pytest.mark.parametrize(("name", "changes", "message"), REFUSED, ids=[m[:40] for *_, m in REFUSED])
def test_import_refuses_what_it_cannot_run_exactly(tmp_path, capsys, name, changes, message):
    _, folder = _saved(tmp_path / "hf", name)
    _edit(folder, changes)
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()}
    capsys.readouterr()
    assert main(["import", "hf", "--model", str(folder), "--out", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("scratchlm import: error:") and len(err.strip().splitlines()) == 1, err
    assert message in err, err
    assert not (tmp_path / "run").exists()
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.iterdir()} == before
