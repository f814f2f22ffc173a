"""Writing a TransformerLM and its Tokenizer as a Hugging Face folder that transformers loads offline.

`export_hf` writes the first of Llama, Qwen2 and Qwen3 that expresses the model exactly (compat/hf.py's
`choose_architecture`), else a ``trust_remote_code`` folder carrying its own modelling code
(compat/hf_custom_code.py), and says which and why. Either folder holds ``config.json`` (a standard one spells
RoPE for transformers 4.x and 5.x alike), ``model.safetensors`` (never pickle), the tokenizer's files as
``Tokenizer.save`` writes them (tokenizer/formats/hf.py: the chat template goes into tokenizer_config.json), and
``generation_config.json`` whose ``eos_token_id`` lists <|endoftext|> and the tokenizer's end-of-turn ids, so
that transformers' generate() stops at the end of a chat turn as we do.
"""

from __future__ import annotations

import json
from pathlib import Path


def export_hf(model, tokenizer, out: Path) -> str:
    """Write `model` (a TransformerLM) and `tokenizer` as a Hugging Face folder `out`; returns one line saying
    which architecture was written and why."""
    from scratchlm.compat.hf import choose_architecture, to_hf_config, to_hf_state_dict, with_both_rope_spellings
    from scratchlm.write_errors import made_folder, naming

    cfg = model.config
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}")
    arch, why = choose_architecture(cfg)
    if arch is None:
        from scratchlm.compat.hf_custom_code import export_custom_code

        export_custom_code(model, tokenizer, out)
        return f"custom code (trust_remote_code=True): no standard architecture: {why}"
    hf_config = to_hf_config(cfg, arch.model_type)
    hf_config.bos_token_id = hf_config.eos_token_id = tokenizer.end_of_text_id
    with made_folder(out):  # a failed export (a full disk) leaves no half-written folder behind
        path = out / "config.json"
        with naming(path):
            hf_config.save_pretrained(out)
            document = with_both_rope_spellings(json.loads(path.read_text(encoding="utf-8")), cfg)
            path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        write_weights_and_tokenizer(out, to_hf_state_dict(model.state_dict(), cfg), tokenizer)
    return why


def write_weights_and_tokenizer(out: Path, state: dict, tokenizer) -> None:
    """``model.safetensors`` of `state`, the tokenizer's Hugging Face files (chat template included) and, when it
    has end-of-turn ids, generation_config.json naming every id that ends a generation."""
    from safetensors.torch import save_file

    from scratchlm.tokenizer.formats.hf import write_hf_tokenizer
    from scratchlm.tokenizer.formats.io import write_atomic
    from scratchlm.write_errors import naming

    tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in state.items()}
    with naming(out / "model.safetensors", sum(t.numel() * t.element_size() for t in tensors.values())):
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    write_hf_tokenizer(out, tokenizer)
    if tokenizer.end_of_turn_ids:
        eos = tokenizer.end_of_text_id
        stops = list(dict.fromkeys([*tokenizer.end_of_turn_ids, *([eos] if eos is not None else [])]))
        generation = {"bos_token_id": eos, "eos_token_id": stops}
        write_atomic(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
