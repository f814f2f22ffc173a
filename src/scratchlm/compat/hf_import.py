"""Reading a Hugging Face model folder (config.json + safetensors [+ tokenizer.json]) as a TransformerLM.

`read_hf_model` reads the model types compat/hf.py maps (llama, mistral, qwen2, qwen3), from ``model.safetensors``
or the shards of ``model.safetensors.index.json``, stored as float32, bfloat16 or float16, built in the dtype asked
for. `read_hf_tokenizer` reads the byte-level BPE tokenizer.json with its chat template and, as the ids that end a
turn, the config's eos_token and every ``eos_token_id`` of generation_config.json; `read_hf_folder` does both.

A hostile folder costs no memory and no time before its error, so the order matters: config.json is parsed and
checked (every unsupported field refused by name), its size bounded from its numbers alone, the model sized on
PyTorch's meta device against `max_gib`, every safetensors header read (compat/safetensors_header.py) and checked
against the shapes the config implies; only then are weights read (only as safetensors, never pickle). Every
problem is a ValueError (or FileNotFoundError) naming the file.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where it is used: `scratchlm --help` imports this module's CLI
    import torch

HF_PACKAGES = ("transformers", "tokenizers")  # the [hf] extra: not part of a plain install
DEFAULT_MAX_GIB = 8.0  # refuse a model whose build would allocate more (--max-gib)
# Tensors some checkpoints carry that our model recomputes (RoPE frequencies): not weights, nothing lost.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_folder(model_dir: Path, *, max_gib: float = DEFAULT_MAX_GIB, dtype: torch.dtype | None = None):
    """(TransformerLM, Tokenizer or None, why the tokenizer is None or None): the folder's model and tokenizer.
    A tokenizer our encoder does not match (WordPiece, a normalizer...) is left out, saying why; the weights are
    still worth having."""
    from scratchlm.tokenizer.formats.hf import HF_TOKENIZER_FILE, UnsupportedHFTokenizer

    model = read_hf_model(model_dir, max_gib=max_gib, dtype=dtype)
    try:
        tokenizer = read_hf_tokenizer(model_dir)
    except UnsupportedHFTokenizer as reason:
        return model, None, f"tokenizer left out: {reason}"
    return model, tokenizer, None if tokenizer else f"no {HF_TOKENIZER_FILE} in {model_dir}"


def read_hf_model(model_dir: Path, *, max_gib: float = DEFAULT_MAX_GIB, dtype: torch.dtype | None = None):
    """A TransformerLM (eval mode, in `dtype`, default float32) with the weights of a Hugging Face folder."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from scratchlm.compat.hf import from_hf_state_dict
    from scratchlm.compat.safetensors_header import FLOAT_DTYPES
    from scratchlm.model import TransformerLM
    from scratchlm.train.checkpoint_state import load_model_state

    model_dir = Path(model_dir)
    dtype = dtype or torch.float32
    cfg = _read_model_config(model_dir / "config.json", max_gib, dtype)
    expected = expected_hf_tensors(cfg, model_dir / "config.json", max_gib, dtype)
    shards = _shard_files(model_dir)
    declared = _declared_tensors(shards)
    if cfg.tie_embeddings and "lm_head.weight" in declared:  # a separate head: checked as the embedding's twin
        expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    check_tensors(declared, expected, FLOAT_DTYPES, where=", ".join(str(shard) for shard in shards),
                  source="config.json", spare={name for name in declared if name.endswith(_IGNORED_SUFFIXES)})
    tensors = {}
    for shard in shards:
        try:
            tensors.update(load_file(str(shard)))
        except SafetensorError as error:  # the header was fine; the library still refuses: name the file
            raise ValueError(f"{shard}: cannot read safetensors file ({error})") from None
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        _check_tied_head(tensors, declared)
    model = TransformerLM(cfg, dtype=dtype)
    load_model_state(model, from_hf_state_dict(tensors, cfg), where=str(model_dir))  # cast to `dtype` here
    return model.eval()


def read_hf_tokenizer(model_dir: Path):
    """Our Tokenizer from the folder's Hugging Face ``tokenizer.json``, with its chat template and end-of-turn ids
    (the module says which), or None when it has no tokenizer.json.

    Raises ``UnsupportedHFTokenizer`` for a tokenizer our encoder does not match (WordPiece, a normalizer...) and
    a ValueError naming the file for a malformed one (tokenizer/formats/hf.py reads it)."""
    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.formats.hf import HF_TOKENIZER_FILE, read_hf_chat

    model_dir = Path(model_dir)
    path = model_dir / HF_TOKENIZER_FILE
    if not path.is_file():
        return None
    tokenizer = Tokenizer.from_files(path)
    template, end_of_turn = read_hf_chat(model_dir, tokenizer.vocab)
    if template is None:
        return tokenizer
    stops = [*end_of_turn, *_generation_eos_ids(model_dir, tokenizer.vocab_size)]
    try:
        return tokenizer.with_chat_template(template, end_of_turn=dict.fromkeys(stops))
    except ValueError as error:  # a named token that is no special token, say
        raise ValueError(f"{model_dir}: {error}") from None


def _generation_eos_ids(model_dir: Path, vocab_size: int) -> list[int]:
    """generation_config.json's eos_token_id (an id or a list of ids): where transformers' generate() stops."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as error:
        raise ValueError(f"{path}: not a JSON object ({error})") from None
    ids = [value] if type(value) is int else value if isinstance(value, list) else []
    if value is not None and not all(type(i) is int and 0 <= i < vocab_size for i in ids):
        raise ValueError(f"{path}: eos_token_id {value!r} is not an id or a list of ids in [0, {vocab_size})")
    return ids


def _read_model_config(path: Path, max_gib: float, dtype: torch.dtype):
    """config.json as our ModelConfig; every JSON, type or architecture problem is a ValueError naming the file."""
    from transformers import AutoConfig

    from scratchlm.compat.hf import ARCHITECTURES, hf_config_to_model_config, rope_spellings

    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a JSON {type(document).__name__}, not an object")
    if document.get("model_type") not in ARCHITECTURES:
        raise ValueError(f"{path}: model_type={document.get('model_type')!r} is not one we read "
                         f"({', '.join(sorted(ARCHITECTURES))})")
    sizes = [document.get(name) for name in ("vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")]
    sizes = [n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1 for n in sizes]  # odd ones: 1
    check_weights_floor(path, *sizes, max_gib, dtype)
    try:
        spellings = rope_spellings(document)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None
    if len(spellings) == 2 and spellings[0] != spellings[1]:  # transformers 4 and 5 would run different models
        raise ValueError(f"{path}: rope_parameters={spellings[0]} disagrees with rope_theta/rope_scaling "
                         f"{spellings[1]} (transformers 5 reads the first, 4.x the second)")
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, local_files_only=True)
    except Exception as error:  # noqa: BLE001 transformers validates with its own exception types (strict dataclasses)
        raise ValueError(f"{path}: {' '.join(str(error).split())}") from None
    try:
        return hf_config_to_model_config(hf_config, spellings[0] if spellings else None)
    except (ValueError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: {error}") from None


def check_weights_floor(path: Path, vocab_size: int, d_model: int, num_layers: int, d_ff: int, max_gib: float,
                        dtype: torch.dtype) -> None:
    """Refuse a model whose embedding and FFN weights alone exceed `max_gib`, from its file's numbers: before
    transformers expands per-layer lists and before a hostile layer count costs the time of sizing the model."""
    gib = (vocab_size * d_model + num_layers * 3 * d_model * d_ff) * dtype.itemsize / 2**30
    if gib > max_gib:
        raise ValueError(f"{path}: describes at least {gib:,.1f} GiB of weights (vocabulary {vocab_size:,}, width "
                         f"{d_model:,}, {num_layers:,} layers), over the --max-gib limit of {max_gib:g}; raise it "
                         f"if you mean it")


def expected_hf_tensors(cfg, config_path: Path, max_gib: float, dtype: torch.dtype) -> dict:
    """{HF name: shape} of the model `cfg` describes, sized on the meta device (no memory); refuses a model whose
    build would allocate more than `max_gib` GiB (weights in `dtype` plus RoPE tables and causal masks)."""
    from scratchlm.compat.hf import to_hf_state_dict
    from scratchlm.model import TransformerLM

    try:
        sized = TransformerLM(cfg, device="meta", dtype=dtype)
    except RuntimeError as error:  # e.g. a context length whose causal mask overflows a size computation
        raise ValueError(f"{config_path}: describes a model too large to build ({error})") from None
    tensors = list(sized.parameters()) + list(sized.buffers())
    gib = sum(t.numel() * t.element_size() for t in tensors) / 2**30
    if gib > max_gib:
        raise ValueError(f"{config_path}: building this model (vocab_size {cfg.vocab_size:,}, context "
                         f"{cfg.context_length:,}, d_model {cfg.d_model:,}, {cfg.num_layers} layers) would "
                         f"allocate {gib:,.1f} GiB, over the --max-gib limit of {max_gib:g}; raise it if you mean it")
    return {name: tuple(t.shape) for name, t in to_hf_state_dict(sized.state_dict(), cfg).items()}


def _shard_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards model.safetensors.index.json lists (each a plain file in `model_dir`)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index}: not a safetensors index (a JSON object with a weight_map of file names): "
                             f"{type(error).__name__}: {error}") from None
        bad = [name for name in names if not isinstance(name, str) or Path(name).name != name]
        if bad:
            raise ValueError(f"{index}: shard {bad[0]!r} is not a file name inside {model_dir}")
        missing = [name for name in names if not (model_dir / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} lists shard {missing[0]} which is not in {model_dir}")
        return [model_dir / name for name in names]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    found = sorted(p.name for p in model_dir.iterdir())
    raise FileNotFoundError(f"{model_dir} has no model.safetensors (found {found}); only safetensors weights "
                            f"are read (pickle-based .bin files are refused)")


def _declared_tensors(shards: list[Path]) -> dict:
    """{tensor name: (shard, shape, dtype)} over all shards; a name in two shards is an error."""
    from scratchlm.compat.safetensors_header import read_safetensors_header

    declared = {}
    for shard in shards:
        for name, entry in read_safetensors_header(shard).items():
            if name in declared:
                raise ValueError(f"{shard}: tensor {name!r} is also in {declared[name][0]}")
            declared[name] = (shard, entry.shape, entry.dtype)
    return declared


def check_tensors(found: dict, expected: dict, readable: Collection[str], *, where: str, source: str,
                  spare: Collection[str] = ()) -> None:
    """Every tensor of `expected` ({name: shape}, as `source` implies) is in `found` ({name: (file, shape, type)})
    with that shape and a type in `readable`; nothing else is but the `spare` names (importing would drop it).
    `where` names the files a missing tensor is not in."""
    for name, shape in expected.items():
        if name not in found:
            raise ValueError(f"{where}: no tensor {name!r}, which {source}'s model needs "
                             f"({len(set(expected) - set(found))} missing)")
        file, found_shape, kind = found[name]
        if found_shape != shape:
            raise ValueError(f"{file}: tensor {name!r} has shape {found_shape} but {source} implies {shape}")
        if kind not in readable:
            raise ValueError(f"{file}: tensor {name!r} is {kind}; we read {', '.join(sorted(readable))}")
    unused = sorted(set(found) - set(expected) - set(spare))
    if unused:
        raise ValueError(f"{found[unused[0]][0]}: holds {len(unused)} tensors {source}'s model has no place for, "
                         f"e.g. {unused[:3]} (importing would drop them)")


def _check_tied_head(tensors: dict, declared: dict) -> None:
    """tie_word_embeddings with a separate lm_head: fine when it equals the embedding, else the head would be lost."""
    import torch

    head, embedding = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    if not torch.equal(head.float(), embedding.float()):
        raise ValueError(f"config.json sets tie_word_embeddings, but lm_head.weight ({declared['lm_head.weight'][0]}) "
                         f"differs from model.embed_tokens.weight ({declared['model.embed_tokens.weight'][0]}): "
                         f"importing would drop the head; set tie_word_embeddings to false to keep it")
