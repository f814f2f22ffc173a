"""Writing a TransformerLM and its Tokenizer as a Hugging Face folder that transformers loads offline.

`export_hf` chooses the architecture by compat/hf.py's `choose_architecture`: Llama, Qwen2 or Qwen3 when one of them
expresses the model exactly (the first of them that does), and says why; the folder then holds ``config.json`` (that
architecture's config, RoPE spelled for transformers 4.x and 5.x alike), ``model.safetensors`` (weights mapped by
compat/hf.py) and the tokenizer's ``tokenizer.json`` + ``tokenizer_config.json``, the files ``Tokenizer.save``
writes too (tokenizer/formats/hf.py: the chat template goes into tokenizer_config.json), and
``generation_config.json`` whose ``eos_token_id`` lists <|endoftext|> and the tokenizer's end-of-turn ids, so that
transformers' generate() stops at the end of a chat turn as we do. A model no standard architecture expresses (a
ReLU² or plain SiLU FFN, LayerNorm, post-norm, no RoPE, a logit cap...) is written by compat/hf_custom_code.py as a
``trust_remote_code`` folder carrying its own modelling code, and the reason is said too.
Weights are written only as safetensors (never pickle).
"""

from __future__ import annotations

import json
from pathlib import Path

from scratchlm.tokenizer.formats.hf import EOS_TOKEN


def export_hf(model, tokenizer, out: Path) -> str:
    """Write `model` (a TransformerLM) and `tokenizer` as a Hugging Face folder `out`; returns one line saying
    which architecture was written and why."""
    from scratchlm.compat.hf import choose_architecture

    if tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model.config.vocab_size}")
    arch, why = choose_architecture(model.config)
    if arch is None:
        from scratchlm.compat.hf_custom_code import export_custom_code

        export_custom_code(model, tokenizer, out)
        return f"custom code (trust_remote_code=True): no standard architecture: {why}"
    _write_standard(model, tokenizer, out, arch.model_type)
    return why


def _write_standard(model, tokenizer, out: Path, model_type: str) -> None:
    from safetensors.torch import save_file

    from scratchlm.compat.hf import to_hf_config, to_hf_state_dict, with_both_rope_spellings
    from scratchlm.write_errors import made_folder, naming

    cfg = model.config
    hf_config = to_hf_config(cfg, model_type)
    eos_id = tokenizer.special_id(EOS_TOKEN) if EOS_TOKEN in tokenizer.special_tokens else None
    hf_config.bos_token_id = hf_config.eos_token_id = eos_id
    tensors = {name: t.detach().cpu().contiguous() for name, t in to_hf_state_dict(model.state_dict(), cfg).items()}
    with made_folder(out):  # a failed export (a full disk) leaves no half-written folder behind
        path = out / "config.json"
        with naming(path):
            hf_config.save_pretrained(out)
            document = with_both_rope_spellings(json.loads(path.read_text(encoding="utf-8")), cfg)
            path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        with naming(out / "model.safetensors", sum(t.numel() * t.element_size() for t in tensors.values())):
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_hf_tokenizer_and_stops(out, tokenizer)


def write_hf_tokenizer_and_stops(out: Path, tokenizer) -> None:
    """The tokenizer's Hugging Face files (chat template included) and, when it has end-of-turn ids,
    generation_config.json naming every id that ends a generation."""
    from scratchlm.tokenizer.formats.hf import write_hf_tokenizer
    from scratchlm.tokenizer.formats.io import write_atomic

    write_hf_tokenizer(out, tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens, tokenizer.pipeline,
                       added_token_flags=tokenizer.added_token_flags, chat_template=tokenizer.chat_template)
    if tokenizer.end_of_turn_ids:
        eos_id = tokenizer.special_id(EOS_TOKEN) if EOS_TOKEN in tokenizer.special_tokens else None
        stops = list(dict.fromkeys([*tokenizer.end_of_turn_ids, *([eos_id] if eos_id is not None else [])]))
        generation = {"bos_token_id": eos_id, "eos_token_id": stops}
        write_atomic(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
