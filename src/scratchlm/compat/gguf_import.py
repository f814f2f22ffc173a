"""Reading a GGUF file (llama.cpp's format) as a TransformerLM and its Tokenizer: `scratchlm import gguf`.

The inverse of compat/gguf_export.py, for llama.cpp's ``llama``, ``qwen2`` and ``qwen3``, with weights stored as
f32, f16, bf16 or q8_0 (dequantised by the `gguf` package). Tensors go GGUF name -> Hugging Face name (the `gguf`
package's table) -> ours (compat/hf.py). A GGUF file is untrusted input: the header is checked before any weight is
read (every hyperparameter we cannot run refused by name, the model sized against `max_gib` as `import hf` does,
every tensor's name, shape and type checked, nothing left over), and every error is one line naming the file.

Llama 3's RoPE scaling comes from our own ``scratchlm.rope.llama3`` key when the file has it, else from the
``rope_freqs`` tensor under Llama 3.1's rule (the factor is the tensor's largest value), which must then reproduce
the tensor. The tokenizer is read as llama.cpp runs it (merges ignored for ``llama-bpe``, no NFC) unless our own
keys say what the exported one did; another kind is left out, saying why, as `import hf` does.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from scratchlm.compat.gguf_export import KEY_IGNORE_MERGES, KEY_LLAMA3, KEY_NFC, PRE_TOKENIZERS, gguf_names

if TYPE_CHECKING:
    import torch

ARCHITECTURES = ("llama", "qwen2", "qwen3")
READABLE_TYPES = ("F32", "F16", "BF16", "Q8_0")
# Llama 3.1's rope_scaling apart from its factor (Llama 3.2 has another factor, the same rest).
_LLAMA31_RULE = dict(rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_context=8192)


class UnsupportedGGUFTokenizer(ValueError):
    """The file's tokenizer is not one our encoder runs exactly (the model can still be imported)."""


def read_gguf(path: Path, *, max_gib: float, dtype: torch.dtype | None = None):
    """(TransformerLM in eval mode and `dtype` (default float32), Tokenizer or None, why it is None or None)."""
    import torch

    from scratchlm.compat.hf import from_hf_state_dict
    from scratchlm.compat.hf_import import check_tensors, check_weights_floor, expected_hf_tensors
    from scratchlm.model import TransformerLM
    from scratchlm.train.checkpoint_state import load_model_state

    path = Path(path)
    dtype = dtype or torch.float32
    reader = _open(path)
    fields = _Fields(reader, path)
    arch = fields.get("general.architecture", str)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: general.architecture={arch!r} is not one we read ({', '.join(ARCHITECTURES)})")
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    cfg = _model_config(fields, arch, tensors, path)
    check_weights_floor(path, cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.d_ff, max_gib, dtype)
    expected = expected_hf_tensors(cfg, path, max_gib, dtype)
    to_gguf = gguf_names(arch, cfg.num_layers, expected)
    found = {name: (path, _shape(tensor), tensor.tensor_type.name) for name, tensor in tensors.items()}
    check_tensors(found, {to_gguf[name]: shape for name, shape in expected.items()}, READABLE_TYPES,
                  where=str(path), source="the header", spare={"rope_freqs.weight"})
    hf = {name: _read_tensor(tensors[to_gguf[name]], path) for name in expected}
    state = from_hf_state_dict(hf, cfg, rope_halves=arch != "llama")  # llama.cpp's llama graph pairs rows as we do
    model = TransformerLM(cfg, dtype=dtype)
    load_model_state(model, state, where=str(path))  # cast to `dtype` here
    try:
        tokenizer = read_gguf_tokenizer(fields, cfg.vocab_size)
    except UnsupportedGGUFTokenizer as reason:
        return model.eval(), None, f"tokenizer left out: {reason}"
    return model.eval(), tokenizer, None


def _open(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    try:
        return GGUFReader(path)
    except Exception as error:  # noqa: BLE001 the reader fails on a malformed file with whatever numpy/struct raise
        raise ValueError(f"{path}: not a readable GGUF file ({type(error).__name__}: "
                         f"{' '.join(str(error).split())[:200]})") from None


class _Fields:
    """The file's key/value metadata, each read with its expected Python type; errors name the file and key."""

    def __init__(self, reader, path: Path) -> None:
        self._fields, self.path = reader.fields, path

    def __contains__(self, key: str) -> bool:
        return key in self._fields

    def get(self, key: str, kind: type, default=None, *, required: bool = True):
        from gguf import GGUFValueType

        if key not in self._fields:
            if default is not None or not required:
                return default
            raise ValueError(f"{self.path}: has no {key}")
        try:
            value = self._fields[key].contents()
        except (UnicodeDecodeError, IndexError, ValueError) as error:
            raise ValueError(f"{self.path}: {key} cannot be read ({error})") from None
        if self._fields[key].types[-1:] == [GGUFValueType.FLOAT32]:  # 1e-5 comes back as 1e-5, not 9.99999974e-06
            value = [_shortest(v) for v in value] if isinstance(value, list) else _shortest(value)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is list and isinstance(value, list):
            return value
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ValueError(f"{self.path}: {key}={_short(value)} is not a {kind.__name__}")
        return value


def _shortest(value: float) -> float:
    """The shortest decimal that is the same float32 (what was written, when it was written from a decimal)."""
    import numpy as np

    return float(str(np.float32(value)))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _model_config(fields: _Fields, arch: str, tensors: dict, path: Path):
    """Our ModelConfig of the file's ``{arch}.*`` hyperparameters; every one we cannot run is refused by name."""
    from scratchlm.model import ModelConfig

    def number(key: str, kind: type = int, default=None):
        return fields.get(f"{arch}.{key}", kind, default)

    for key in (f"{arch}.attention.sliding_window", f"{arch}.expert_count"):  # before the keys we need
        if key in fields:
            raise ValueError(f"{path}: unsupported {arch} model: {key}={_short(fields.get(key, object))} (ours is "
                             f"a dense model attending to the whole context)")
    heads = number("attention.head_count")
    d_model = number("embedding_length")
    head_dim = number("attention.key_length", int, (d_model // heads) if isinstance(heads, int) and heads else None)
    problems = []
    if number("attention.value_length", int, head_dim) != head_dim:
        problems.append(f"{arch}.attention.value_length={number('attention.value_length')} differs from the "
                        f"key length {head_dim} (ours are equal)")
    if number("rope.dimension_count", int, head_dim) != head_dim:
        problems.append(f"{arch}.rope.dimension_count={number('rope.dimension_count')} (our RoPE rotates the "
                        f"whole head of {head_dim})")
    scaling_type = fields.get(f"{arch}.rope.scaling.type", str, required=False)
    if scaling_type not in (None, "none"):
        problems.append(f"{arch}.rope.scaling.type={scaling_type!r} (ours are none or Llama 3's rope_freqs)")
    scaling_factor = fields.get(f"{arch}.rope.scaling.factor", float, required=False)
    if scaling_factor not in (None, 0.0, 1.0):
        problems.append(f"{arch}.rope.scaling.factor={scaling_factor!r} (no linear RoPE scaling here)")
    if problems:
        raise ValueError(f"{path}: unsupported {arch} model: " + "; ".join(problems))
    tokens = fields.get("tokenizer.ggml.tokens", list, required=False)
    embedding = tensors.get("token_embd.weight")
    vocab_size = number("vocab_size", int, len(tokens) if tokens else
                        (int(embedding.shape[-1]) if embedding is not None and len(embedding.shape) == 2 else None))
    options = dict(
        vocab_size=vocab_size, context_length=number("context_length"), d_model=d_model,
        num_layers=number("block_count"), num_heads=heads, num_kv_heads=number("attention.head_count_kv", int, heads),
        head_dim=head_dim, d_ff=number("feed_forward_length"), rope_theta=number("rope.freq_base", float, 10_000.0),
        norm_eps=number("attention.layer_norm_rms_epsilon", float), tie_embeddings="output.weight" not in tensors,
        qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3")
    if "rope_freqs.weight" in tensors:
        if arch != "llama":
            raise ValueError(f"{path}: tensor rope_freqs.weight in a {arch} file (llama.cpp reads it only for llama)")
        options |= _llama3_fields(fields, tensors["rope_freqs.weight"], options, path)
    try:
        return ModelConfig(**options)
    except (ValueError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: {error}") from None


def _llama3_fields(fields: _Fields, tensor, options: dict, path: Path) -> dict:
    """Our llama3 rope_* fields that give the file's rope_freqs tensor (the divisor of each frequency)."""
    import torch

    from scratchlm.compat.gguf_export import rope_freqs
    from scratchlm.model.attention import Llama3Scaling

    factors = _read_tensor(tensor, path).float()
    head_dim, theta = options["head_dim"], options["rope_theta"]
    if not isinstance(head_dim, int) or factors.shape != (head_dim // 2,):
        raise ValueError(f"{path}: rope_freqs.weight has shape {tuple(factors.shape)}, not (head_dim/2,)")
    given = fields.get(KEY_LLAMA3, list, required=False)
    if given is not None and len(given) == 4:
        fields_ = dict(rope_scaling_factor=float(given[0]), rope_low_freq_factor=float(given[1]),
                       rope_high_freq_factor=float(given[2]), rope_original_context=int(given[3]))
    else:
        fields_ = dict(rope_scaling_factor=float(factors.max()), **_LLAMA31_RULE)
    scaling = Llama3Scaling(fields_["rope_scaling_factor"], fields_["rope_low_freq_factor"],
                            fields_["rope_high_freq_factor"], fields_["rope_original_context"])
    if not torch.allclose(rope_freqs(theta, head_dim, scaling), factors, rtol=1e-5, atol=0.0):
        raise ValueError(f"{path}: rope_freqs.weight is not Llama 3's RoPE scaling rule with {fields_}: we cannot "
                         f"run these frequencies exactly")
    return {"rope_scaling": "llama3", **fields_}


def _shape(tensor) -> tuple[int, ...]:
    """A tensor's shape in numpy's (row-major) order: GGUF lists the fastest dimension first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


def _read_tensor(tensor, path: Path) -> torch.Tensor:
    """One tensor as float32, dequantised, in numpy's (row-major) shape."""
    import numpy as np
    import torch
    from gguf import quants

    try:
        with np.errstate(all="ignore"):  # a damaged scale gives inf/NaN: refused below, by name
            values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(_shape(tensor))
    except (ValueError, NotImplementedError) as error:
        raise ValueError(f"{path}: tensor {tensor.name!r} cannot be read ({error})") from None
    values = np.array(values, dtype=np.float32)  # a copy: the reader's arrays map the file
    if not np.isfinite(values).all():
        raise ValueError(f"{path}: tensor {tensor.name!r} holds NaN or infinite values")
    return torch.from_numpy(values)


def read_gguf_tokenizer(fields: _Fields, vocab_size: int):
    """Our Tokenizer of the file's ``tokenizer.ggml.*`` keys; UnsupportedGGUFTokenizer when it is not byte-level
    BPE split as ours splits, ValueError for a malformed one."""
    from gguf import TokenType

    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.formats.io import from_gpt2_merge, from_gpt2_string
    from scratchlm.tokenizer.pipeline import Pipeline

    model = fields.get("tokenizer.ggml.model", str, required=False)
    if model is None:
        raise UnsupportedGGUFTokenizer("the file has no tokenizer.ggml.model")
    if model != "gpt2":
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.model={model!r} (we run byte-level BPE, 'gpt2')")
    pre = fields.get("tokenizer.ggml.pre", str, "default")
    patterns = {name: (pattern, ignores) for pattern, (name, ignores) in PRE_TOKENIZERS.items()}
    if pre not in patterns:
        raise UnsupportedGGUFTokenizer(f"tokenizer.ggml.pre={pre!r} (we split as {', '.join(patterns)})")
    pattern, ignores_merges = patterns[pre]
    tokens = fields.get("tokenizer.ggml.tokens", list)
    types = fields.get("tokenizer.ggml.token_type", list, required=False) or [TokenType.NORMAL] * len(tokens)
    merges = fields.get("tokenizer.ggml.merges", list, required=False) or []
    if len(types) != len(tokens) or len(tokens) > vocab_size:
        raise ValueError(f"{fields.path}: {len(tokens)} tokens, {len(types)} token types, a model of "
                         f"{vocab_size} ids")
    vocab, specials = {}, []
    for token_id, (text, kind) in enumerate(zip(tokens, types)):
        if kind == TokenType.NORMAL:
            vocab[token_id] = from_gpt2_string(text, f"{fields.path}: tokenizer.ggml.tokens[{token_id}]")
        elif kind in (TokenType.CONTROL, TokenType.USER_DEFINED):
            vocab[token_id] = text.encode("utf-8")
            specials.append(text)
        elif kind != TokenType.UNUSED:
            raise UnsupportedGGUFTokenizer(f"token {token_id} {text!r} has type {kind} (byte-level BPE has normal, "
                                           f"control, user-defined and unused tokens)")
    pairs = [from_gpt2_merge(merge, f"{fields.path}: tokenizer.ggml.merges[{rank}]")
             for rank, merge in enumerate(merges)]
    ignore_merges = fields.get(KEY_IGNORE_MERGES, bool, required=False)  # our export says; else llama.cpp's rule
    pipeline = Pipeline(pattern, nfc=fields.get(KEY_NFC, bool, False),
                        ignore_merges=ignores_merges if ignore_merges is None else ignore_merges)
    try:
        tokenizer = Tokenizer(vocab, pairs, specials, pipeline=pipeline)
        template = fields.get("tokenizer.chat_template", str, required=False)
        if template is None:
            return tokenizer
        end_of_turn = fields.get("tokenizer.ggml.eot_token_id", int, required=False)
        return tokenizer.with_chat_template(template, end_of_turn=[] if end_of_turn is None else [end_of_turn])
    except ValueError as error:
        raise ValueError(f"{fields.path}: tokenizer: {error}") from None
