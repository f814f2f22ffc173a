"""Export any TransformerLM as a Hugging Face custom-code folder: what no standard architecture expresses.

ReLU² or SiLU FFNs, logit soft-capping, post-norm, LayerNorm, no norm and NoPE have no transformers class. For
those the folder follows transformers' custom-code convention: config.json has a ``model_type`` of our own
("scratchlm"), every ModelConfig field (rope_scaling as rope_scaling_type) and an ``auto_map``; compat/hf_remote/'s
configuration and modeling files are copied beside the weights (our own names: nothing is permuted; a tied head is
stored once, as the embedding), so that ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)``
builds the model (equal logits, working ``generate()``) under transformers 4.57 and 5.x, with nothing of
scratchlm installed. tests/test_export_custom_code.py proves it equal to TransformerLM for each switch.
"""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

MODEL_TYPE = "scratchlm"
CONFIG_FILE, MODELING_FILE = "configuration_scratchlm.py", "modeling_scratchlm.py"
AUTO_MAP = {"AutoConfig": "configuration_scratchlm.ScratchLMConfig",
            "AutoModelForCausalLM": "modeling_scratchlm.ScratchLMForCausalLM"}


def export_custom_code(model, tokenizer, out: Path) -> None:
    """Write `model` (a TransformerLM) and `tokenizer` (which export_hf has checked fits it) as a custom-code
    Hugging Face folder `out` (module docstring)."""
    from scratchlm.compat.hf_export import write_weights_and_tokenizer
    from scratchlm.write_errors import made_folder, naming

    cfg = model.config
    state = model.state_dict()
    if cfg.tie_embeddings:  # one tensor under two names: safetensors stores it once, as the modeling file reads it
        del state["lm_head.weight"]
    config = cfg.to_dict()
    config["rope_scaling_type"] = config.pop("rope_scaling")  # a reserved name in transformers (a dict there)
    eos = tokenizer.end_of_text_id
    config |= {"model_type": MODEL_TYPE, "architectures": ["ScratchLMForCausalLM"], "auto_map": AUTO_MAP,
               "bos_token_id": eos, "eos_token_id": eos, "tie_word_embeddings": False,
               "dtype": str(state["token_embeddings.weight"].dtype).removeprefix("torch.")}
    templates = files("scratchlm.compat.hf_remote")
    with made_folder(out):  # a failed export (a full disk) leaves no half-written folder behind
        with naming(out / "config.json"):
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name in (CONFIG_FILE, MODELING_FILE):
            with naming(out / name):
                (out / name).write_bytes(templates.joinpath(name).read_bytes())
        write_weights_and_tokenizer(out, state, tokenizer)
