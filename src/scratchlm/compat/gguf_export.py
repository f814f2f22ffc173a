"""Writing a TransformerLM and its Tokenizer as one GGUF file that llama.cpp (ollama, LM Studio, llama-cpp-python)
loads and decodes as we do.

The architecture is the one `export hf` writes (compat/hf.py's `choose_architecture`) under llama.cpp's name
(``llama``, ``qwen2``, ``qwen3``); a model none of them expresses is refused naming the field and value, before
anything is written. Tensor names come from the `gguf` package's own Hugging Face -> GGUF table. llama.cpp's
``llama`` graph rotates adjacent RoPE pairs as we do, its Qwen graphs rotate halves as Hugging Face does, so a
``llama`` file holds our Q/K rows as they are and a Qwen file Hugging Face's. Llama 3's RoPE scaling is llama.cpp's
``rope_freqs`` tensor (one divisor per frequency), which only its ``llama`` graph reads.

The tokenizer is byte-level BPE (``tokenizer.ggml.model = "gpt2"``) with ``tokenizer.ggml.pre`` naming our split
pattern (`PRE_TOKENIZERS`; an unknown one is refused). llama.cpp ignores merges for ``llama-bpe`` and applies them
otherwise; a pipeline that says the other thing is written only when that changes no token's encoding. llama.cpp
runs no NFC: such a tokenizer is written with a note. Types: f32, f16 and q8_0 (2-D weights only; a row that is
not whole q8_0 blocks falls back to f16, as llama.cpp's converter does). The file appears only when complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.tokenizer.pretokenize import GPT2_SPLIT_PATTERN, LLAMA3_SPLIT_PATTERN, QWEN2_SPLIT_PATTERN

if TYPE_CHECKING:  # numpy, torch and gguf are imported where they are used
    import numpy as np
    import torch

GGUF_TYPES = ("f32", "f16", "q8_0")
# Our split pattern -> (llama.cpp's tokenizer.ggml.pre, whether llama.cpp ignores merges for it).
PRE_TOKENIZERS = {GPT2_SPLIT_PATTERN: ("gpt-2", False), LLAMA3_SPLIT_PATTERN: ("llama-bpe", True),
                  QWEN2_SPLIT_PATTERN: ("qwen2", False)}
# Keys of our own (llama.cpp ignores keys it does not know): what lets `import gguf` rebuild the exact model.
KEY_VERSION, KEY_RUN = "scratchlm.version", "scratchlm.run"
KEY_NFC, KEY_IGNORE_MERGES = "scratchlm.tokenizer.nfc", "scratchlm.tokenizer.ignore_merges"
KEY_LLAMA3 = "scratchlm.rope.llama3"  # [factor, low_freq_factor, high_freq_factor, original_context]
Q8_0_BLOCK = 32


@dataclass(frozen=True)
class GGUFPlan:
    """What `export_gguf` will write: llama.cpp's architecture name, why, and the notes to tell the user."""

    arch: str
    why: str
    pre: str
    notes: tuple[str, ...]


def plan_gguf(model_config, tokenizer) -> GGUFPlan:
    """The architecture and tokenizer settings of the GGUF file of this model, or ValueError naming the one field
    and value llama.cpp cannot express (nothing is written before this passes)."""
    from scratchlm.compat.hf import choose_architecture

    arch, why = choose_architecture(model_config)
    if arch is None:
        raise ValueError(f"llama.cpp cannot run this model: {why}")
    if model_config.rope_scaling != "none" and arch.model_type != "llama":
        raise ValueError(f"rope_scaling={model_config.rope_scaling!r} with {arch.model_type}'s layout: llama.cpp "
                         f"reads Llama 3's rope_freqs only in its llama graph")
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {model_config.vocab_size}")
    if not tokenizer.merges:  # GGUF has no empty arrays, and llama.cpp refuses a gpt2 tokenizer without the key
        raise ValueError("tokenizer has no merges: llama.cpp's byte-level BPE ('gpt2') needs tokenizer.ggml.merges "
                         "with at least one")
    pipeline = tokenizer.pipeline
    if pipeline.pattern not in PRE_TOKENIZERS:
        raise ValueError(f"tokenizer split pattern {pipeline.pattern!r} is not one llama.cpp knows (GPT-2's, "
                         f"Llama 3's or Qwen2's): llama.cpp would split text differently")
    pre, ignores_merges = PRE_TOKENIZERS[pipeline.pattern]
    if pipeline.ignore_merges != ignores_merges and (token := _merge_dependent_token(tokenizer)) is not None:
        raise ValueError(f"tokenizer ignore_merges={pipeline.ignore_merges!r}, but llama.cpp's {pre!r} "
                         f"{'ignores' if ignores_merges else 'applies'} merges, and token {token!r} would encode "
                         f"differently")
    notes = []
    if pipeline.nfc:
        notes.append("llama.cpp does not put text in NFC as this tokenizer does: text not already in NFC may "
                     "tokenize differently there")
    return GGUFPlan(arch.model_type, f"{arch.model_type} ({why})", pre, tuple(notes))


def _merge_dependent_token(tokenizer) -> bytes | None:
    """An ordinary token whose bytes, as one pre-token, BPE-merge to something else (None: there is none, so
    ignoring merges for whole-token pre-tokens changes no id)."""
    from scratchlm.tokenizer.bpe import bpe_merge, merge_table
    from scratchlm.tokenizer.formats.io import invert_vocab

    to_id = invert_vocab(tokenizer.vocab)
    table = merge_table(tokenizer.merges, to_id)
    specials = set(tokenizer.special_tokens)
    for token_id, data in sorted(tokenizer.vocab.items()):
        ordinary = len(data) > 1 and data.decode("utf-8", "replace") not in specials
        if ordinary and bpe_merge([to_id[bytes([byte])] for byte in data], table) != [token_id]:
            return data
    return None


def export_gguf(model, tokenizer, out: Path, gguf_type: str = "f32", *, name: str, run: str | None = None) -> GGUFPlan:
    """Write `model` (a TransformerLM) and `tokenizer` as the GGUF file `out` (`gguf_type` one of GGUF_TYPES;
    `name` is general.name, `run` where the model came from); returns the plan written. Refusals (ValueError)
    come before any file is created; a failed write leaves no file behind."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"GGUF type {gguf_type!r} is not one of {GGUF_TYPES}")
    out = Path(out)
    plan = plan_gguf(model.config, tokenizer)
    tensors = gguf_tensors(model, plan.arch)
    temporary = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        writer = gguf.GGUFWriter(temporary, plan.arch)
        _add_metadata(writer, model.config, gguf_type, name, run)
        _add_tokenizer(writer, tokenizer, model.config.vocab_size, plan.pre)
        for tensor_name, array in tensors.items():
            data, qtype = _encoded(array, gguf_type)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        for handle in writer.fout or ():
            handle.flush()
            os.fsync(handle.fileno())
        writer.close()
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    return plan


def gguf_tensors(model, arch: str) -> dict[str, np.ndarray]:
    """{llama.cpp tensor name: float32 array in numpy's row-major shape} of `model` for the `arch` graph."""
    import gguf

    from scratchlm.compat.hf import to_hf_state_dict
    from scratchlm.model.attention import Llama3Scaling

    cfg = model.config
    ours = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
    hf = to_hf_state_dict(ours, cfg, rope_halves=arch != "llama")  # llama.cpp's llama graph pairs rows as we do
    names = gguf_names(arch, cfg.num_layers, hf)
    tensors = {names[hf_name]: tensor.numpy() for hf_name, tensor in hf.items()}
    scaling = Llama3Scaling.of(cfg)
    if scaling is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        tensors[name] = rope_freqs(cfg.rope_theta, cfg.head_dim, scaling).numpy()
    return tensors


def rope_freqs(theta: float, head_dim: int, scaling) -> torch.Tensor:
    """llama.cpp's rope_freqs (head_dim/2,): ω / ω_scaled, the divisor of each frequency ω = θ^(-2i/head_dim)
    under `scaling` (a Llama3Scaling)."""
    import torch

    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    return inv_freq / scaling(inv_freq)


def gguf_names(arch: str, num_layers: int, hf_names) -> dict[str, str]:
    """{Hugging Face name: llama.cpp name} of each of `hf_names` in the `arch` graph, by the `gguf` package's table."""
    import gguf

    model_arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == arch)
    table = gguf.get_tensor_name_map(model_arch, num_layers)
    names = {name: table.get_name(name, try_suffixes=(".weight", ".bias")) for name in hf_names}
    if None in names.values():  # a bug, not the user's: every name compat/hf.py writes has a GGUF name
        raise AssertionError(f"no GGUF name for {[name for name, found in names.items() if found is None]}")
    return names


def _encoded(array: np.ndarray, gguf_type: str) -> tuple[np.ndarray, object]:
    """(data, its GGML type) of one float32 tensor stored as `gguf_type` (1-D tensors stay f32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if gguf_type == "f32" or array.ndim < 2:
        return np.ascontiguousarray(array, dtype=np.float32), GGMLQuantizationType.F32
    if gguf_type == "q8_0" and array.shape[-1] % Q8_0_BLOCK == 0:
        return quants.quantize(array, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    return np.ascontiguousarray(array, dtype=np.float16), GGMLQuantizationType.F16


def _add_metadata(writer, cfg, gguf_type: str, name: str, run: str | None) -> None:
    import gguf

    from scratchlm import __version__

    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_description(f"exported by scratchlm {__version__}" + (f" from {run}" if run else ""))
    writer.add_string(KEY_VERSION, __version__)
    if run:
        writer.add_string(KEY_RUN, run)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.norm_eps))
    if cfg.rope_scaling == "llama3":
        writer.add_array(KEY_LLAMA3, [float(cfg.rope_scaling_factor), float(cfg.rope_low_freq_factor),
                                      float(cfg.rope_high_freq_factor), float(cfg.rope_original_context)])


def _add_tokenizer(writer, tokenizer, vocab_size: int, pre: str) -> None:
    from gguf import TokenType

    from scratchlm.tokenizer.formats.io import to_gpt2_string

    specials = {tokenizer.special_id(token): token for token in tokenizer.special_tokens}
    tokens, types = [], []
    for token_id in range(vocab_size):
        if token_id in specials:
            tokens.append(specials[token_id])
            types.append(TokenType.CONTROL)
        elif token_id in tokenizer.vocab:
            tokens.append(to_gpt2_string(tokenizer.vocab[token_id]))
            types.append(TokenType.NORMAL)
        else:  # the model's embedding rows past the tokenizer (pad_vocab_to): never produced by encoding
            tokens.append(f"[PAD{token_id}]")
            types.append(TokenType.UNUSED)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([f"{to_gpt2_string(a)} {to_gpt2_string(b)}" for a, b in tokenizer.merges])
    writer.add_bool(KEY_NFC, tokenizer.pipeline.nfc)
    writer.add_bool(KEY_IGNORE_MERGES, tokenizer.pipeline.ignore_merges)
    if (eos := tokenizer.end_of_text_id) is not None:
        writer.add_bos_token_id(eos)  # as export hf: our models start without a BOS; documents end with this
        writer.add_eos_token_id(eos)
    if tokenizer.end_of_turn_ids:  # where a chat turn ends (llama.cpp stops there too)
        writer.add_eot_token_id(tokenizer.end_of_turn_ids[0])
    writer.add_add_bos_token(False)  # we never prepend one (llama.cpp would for llama-bpe by default)
    writer.add_add_eos_token(False)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template.source)
