"""Export any TransformerLM as a Hugging Face custom-code folder: what no standard architecture expresses.

Llama (compat/hf.py) holds only some of our switches; ReLU² or SiLU FFNs, logit soft-capping, post-norm,
LayerNorm, no norm, NoPE have no transformers class. For those the folder follows transformers' custom-code
convention: a ``model_type`` of our own ("scratchlm"), an ``auto_map`` naming the classes, and the modeling
code written beside the weights, so that

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

builds the model (equal logits, working ``generate()``) under transformers 4.57 and 5.x, with nothing of
scratchlm installed. The folder::

    config.json                  ScratchLMConfig: every ModelConfig field (rope_scaling as rope_scaling_type),
                                 auto_map, bos/eos = <|endoftext|> when the tokenizer has it
    configuration_scratchlm.py   the config class  } copied from compat/hf_remote/, byte for byte; they
    modeling_scratchlm.py        the model class   } import only torch and transformers
    model.safetensors            our state dict under our own names (a tied head is stored once, as the
                                 embedding); the modeling file uses the same names, so nothing is permuted
    tokenizer.json, tokenizer_config.json   as `scratchlm export hf` writes them

The modeling file reimplements our forward pass with torch.nn (it is an export target, not our from-scratch
code); tests/test_export_custom_code.py proves it equal to TransformerLM for each switch.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

from scratchlm.tokenizer.formats.hf import EOS_TOKEN

MODEL_TYPE = "scratchlm"
CONFIG_FILE, MODELING_FILE = "configuration_scratchlm.py", "modeling_scratchlm.py"
AUTO_MAP = {"AutoConfig": "configuration_scratchlm.ScratchLMConfig",
            "AutoModelForCausalLM": "modeling_scratchlm.ScratchLMForCausalLM"}
# ModelConfig fields whose name means something else to transformers: (ours, config.json's).
_RENAMED = {"rope_scaling": "rope_scaling_type"}


def custom_code_config(cfg, eos_id: int | None, dtype: str) -> dict:
    """config.json of the folder: our ModelConfig `cfg` plus what transformers reads to find and build it."""
    fields = {_RENAMED.get(name, name): value for name, value in cfg.to_dict().items()}
    return {**fields, "model_type": MODEL_TYPE, "architectures": ["ScratchLMForCausalLM"], "auto_map": AUTO_MAP,
            "bos_token_id": eos_id, "eos_token_id": eos_id, "tie_word_embeddings": False, "dtype": dtype}


def export_custom_code(model, tokenizer, out: Path) -> None:
    """Write `model` (a TransformerLM) and `tokenizer` as a custom-code Hugging Face folder `out` (module docstring)."""
    from safetensors.torch import save_file

    from scratchlm.compat.hf_export import write_hf_tokenizer_and_stops
    from scratchlm.write_errors import made_folder, naming

    cfg = model.config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}")
    eos_id = tokenizer.special_id(EOS_TOKEN) if EOS_TOKEN in tokenizer.special_tokens else None
    state = model.state_dict()
    if cfg.tie_embeddings:  # one tensor under two names: safetensors stores it once, as the modeling file reads it
        del state["lm_head.weight"]
    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    config = custom_code_config(cfg, eos_id, dtype)
    templates = files("scratchlm.compat.hf_remote")
    with made_folder(out):  # a failed export (a full disk) leaves no half-written folder behind
        with naming(out / "config.json"):
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name in (CONFIG_FILE, MODELING_FILE):
            with naming(out / name):
                (out / name).write_bytes(templates.joinpath(name).read_bytes())
        with naming(out / "model.safetensors", sum(t.numel() * t.element_size() for t in tensors.values())):
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_hf_tokenizer_and_stops(out, tokenizer)
