"""`scratchlm export hf` and `scratchlm import hf`: trade checkpoints with the Hugging Face ecosystem.

Export writes a folder that `transformers.AutoModelForCausalLM` and `AutoTokenizer` load offline:
``config.json`` (a LlamaConfig), ``model.safetensors`` (weights mapped by compat/hf.py) and the tokenizer's
``tokenizer.json`` + ``tokenizer_config.json``, the files ``Tokenizer.save`` writes too (tokenizer/hf_format.py).
Import reads a Llama folder of a matching architecture (refusing GQA, biases, RoPE scaling with a clear error)
into a run directory that `generate` and `eval` accept: ``config.toml``, a step-0 checkpoint written by the
checkpoint module, and ``tokenizer/`` when the folder has a byte-level BPE tokenizer that our encoder matches
(another kind is left out, saying why). Weights are read and written only as safetensors (never pickle).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from scratchlm.tokenizer.hf_format import EOS_TOKEN

HF_PACKAGES = ("transformers", "tokenizers")  # the [hf] extra: not part of a plain install
DEFAULT_MAX_GIB = 8.0  # import hf refuses a model whose build would allocate more (--max-gib)
# Tensors some Llama checkpoints carry that our model recomputes (RoPE frequencies): not weights, nothing lost.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="export a checkpoint to another format",
                                   description="Export a checkpoint to another ecosystem.")
    export_formats = export.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = export_formats.add_parser("hf", help="Hugging Face transformers folder (Llama)",
                                   description="Write config.json + model.safetensors + tokenizer files that "
                                               "transformers' AutoModelForCausalLM / AutoTokenizer load offline.")
    hf.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
    hf.add_argument("--out", required=True, type=Path, help="output folder")
    hf.add_argument("--tokenizer", type=Path, help="tokenizer directory (default: the run's copy, RUN/tokenizer)")
    hf.add_argument("--force", action="store_true", help="write into an existing folder that holds files")
    hf.add_argument("--push-to-hub", metavar="OWNER/NAME",
                    help="then upload the folder to this Hugging Face model repository, created when missing (token: "
                         "HF_TOKEN or `hf auth login`; needs the [hub] extra)")
    hf.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    hf.set_defaults(func=run_export_hf)

    imp = subparsers.add_parser("import", help="import a checkpoint from another format",
                                description="Import a model from another ecosystem as a scratchlm run directory.")
    import_formats = imp.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = import_formats.add_parser("hf", help="Hugging Face Llama folder (safetensors)",
                                   description="Read a Llama folder (config.json + *.safetensors [+ tokenizer.json]) "
                                               "of a matching architecture into a run directory.")
    hf.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    hf.add_argument("--out", required=True, type=Path, help="run directory to create")
    hf.add_argument("--max-gib", type=float, default=DEFAULT_MAX_GIB,
                    help=f"refuse a config.json whose model would allocate more than this many GiB before its "
                         f"weights are checked (default {DEFAULT_MAX_GIB:g})")
    hf.add_argument("--force", action="store_true", help="write into an existing folder that holds files")
    hf.set_defaults(func=run_import_hf)


# ---------------------------------------------------------------------------------------------------- export

def run_export_hf(args: argparse.Namespace) -> int:
    from scratchlm.errors import UserError
    from scratchlm.extras import require
    from scratchlm.hub import push_folder, require_hub
    from scratchlm.output_paths import refuse_foreign_folder, refuse_inputs, removed_on_failure
    from scratchlm.train.checkpoint import load_for_inference
    from scratchlm.train.tokenizer_identity import tokenizer_for_run

    for package in HF_PACKAGES:  # checked first: one line naming the extra, not a traceback halfway through
        require(package, "hf", "scratchlm export hf")
    if args.private and not args.push_to_hub:
        raise UserError("--private is for --push-to-hub (the visibility of the repository it creates)")
    if args.push_to_hub:
        require_hub("scratchlm export hf --push-to-hub")

    refuse_inputs(args.out, [args.checkpoint, *([args.tokenizer] if args.tokenizer else [])])
    refuse_foreign_folder(args.out, force=args.force)
    model, config = load_for_inference(args.checkpoint)
    tokenizer = tokenizer_for_run(args.checkpoint, config, args.tokenizer)  # refuses another tokenizer
    with removed_on_failure(args.out):
        export_hf(model, tokenizer, args.out)
    print(f"wrote {args.out}/: config.json, model.safetensors, tokenizer.json, tokenizer_config.json")
    if args.push_to_hub:  # after the export, which stays on disk if the upload fails
        print(f"pushed {args.out}/ to {push_folder(args.out, args.push_to_hub, private=args.private)}")
    return 0


def export_hf(model, tokenizer, out: Path) -> None:
    """Write `model` (a TransformerLM) and `tokenizer` as a Hugging Face Llama folder."""
    from safetensors.torch import save_file

    from scratchlm.compat.hf import to_hf_llama_config, to_hf_state_dict
    from scratchlm.tokenizer.hf_format import write_hf_tokenizer
    from scratchlm.write_errors import made_folder, naming

    cfg = model.config
    hf_config = to_hf_llama_config(cfg)  # refuses non-Llama architectures with a clear error
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}")
    eos_id = tokenizer.special_id(EOS_TOKEN) if EOS_TOKEN in tokenizer.special_tokens else None
    hf_config.bos_token_id = hf_config.eos_token_id = eos_id
    hf_config.architectures = ["LlamaForCausalLM"]
    tensors = {name: t.detach().cpu().contiguous() for name, t in to_hf_state_dict(model.state_dict(), cfg).items()}
    with made_folder(out):  # a failed export (a full disk) leaves no half-written folder behind
        with naming(out / "config.json"):
            hf_config.save_pretrained(out)
            _write_both_rope_spellings(out / "config.json", cfg.rope_theta)
        with naming(out / "model.safetensors", sum(t.numel() * t.element_size() for t in tensors.values())):
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        write_hf_tokenizer(out, tokenizer.vocab, tokenizer.merges, tokenizer.special_tokens)


def _write_both_rope_spellings(path: Path, rope_theta: float) -> None:
    from scratchlm.compat.hf import with_both_rope_spellings

    document = with_both_rope_spellings(json.loads(path.read_text(encoding="utf-8")), rope_theta)
    path.write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------------- import

def run_import_hf(args: argparse.Namespace) -> int:
    from scratchlm.errors import UserError
    from scratchlm.extras import require
    from scratchlm.output_paths import refuse_foreign_folder, refuse_inputs, removed_on_failure
    from scratchlm.tokenizer.hf_format import HF_TOKENIZER_FILE, UnsupportedHFTokenizer

    for package in HF_PACKAGES:
        require(package, "hf", "scratchlm import hf")

    model_dir, run_dir = args.model, args.out
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model folder (no config.json)")
    refuse_inputs(run_dir, [model_dir])
    if (run_dir / "checkpoints").exists():
        raise UserError(f"{run_dir} already holds a run (checkpoints/); choose a new --out")
    refuse_foreign_folder(run_dir, force=args.force)
    model = read_hf_llama(model_dir, max_gib=args.max_gib)
    try:
        tokenizer = read_hf_tokenizer(model_dir)
        missing = f"no {HF_TOKENIZER_FILE} in {model_dir}"
    except UnsupportedHFTokenizer as reason:  # another kind of tokenizer: the weights are still worth importing
        tokenizer, missing = None, f"tokenizer left out: {reason}"
    with removed_on_failure(run_dir):
        checkpoint = write_run(model, tokenizer, run_dir)
    note = "" if tokenizer else f" ({missing}; pass --tokenizer to generate)"
    print(f"wrote run directory {run_dir} with checkpoint {checkpoint}{note}")
    return 0


def read_hf_llama(model_dir: Path, *, max_gib: float = DEFAULT_MAX_GIB):
    """A TransformerLM with the weights of a Hugging Face Llama folder (safetensors only).

    Order matters: config.json is checked and the model's size estimated on the meta device, then every weights
    file's header is checked against the file's size and against the shapes the config implies, and only then
    is a model built and are weights read: a hostile folder costs no memory and no time before its error."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from scratchlm.compat.hf import from_hf_state_dict
    from scratchlm.model import TransformerLM
    from scratchlm.train.checkpoint_state import load_model_state

    cfg = _read_model_config(model_dir / "config.json")
    expected = _expected_hf_tensors(cfg, model_dir / "config.json", max_gib)
    shards = _shard_files(model_dir)
    declared = _declared_tensors(shards)
    _check_declared(declared, expected, cfg, where=", ".join(str(shard) for shard in shards))
    tensors = {}
    for shard in shards:
        try:
            tensors.update(load_file(str(shard)))
        except SafetensorError as error:  # the header was fine; the library still refuses: name the file
            raise ValueError(f"{shard}: cannot read safetensors file ({error})") from None
    if cfg.tie_embeddings and "lm_head.weight" in tensors:
        _check_tied_head(tensors, declared)
    model = TransformerLM(cfg)
    load_model_state(model, from_hf_state_dict(tensors, cfg), where=str(model_dir))
    return model.eval()


def _read_model_config(path: Path):
    """config.json as our ModelConfig; every JSON, type or architecture problem is a ValueError naming the file."""
    from types import SimpleNamespace

    from transformers import AutoConfig

    from scratchlm.compat.hf import hf_config_to_model_config, rope_settings

    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path}: a JSON {type(document).__name__}, not an object")
    if document.get("model_type") != "llama":
        raise ValueError(f"{path}: model_type {document.get('model_type')!r} is not 'llama'; only Llama "
                         f"checkpoints of a matching architecture can be imported")
    try:
        hf_config = AutoConfig.from_pretrained(path.parent, local_files_only=True)
    except Exception as error:  # noqa: BLE001 transformers validates with its own exception types (strict dataclasses)
        raise ValueError(f"{path}: {' '.join(str(error).split())}") from None
    # Checked on the JSON too: a transformers version may drop the other version's spelling of RoPE scaling.
    _, scaling = rope_settings(SimpleNamespace(**document))
    if scaling != "default":
        raise ValueError(f"{path}: unsupported Hugging Face Llama config: RoPE scaling {scaling!r} (our RoPE has none)")
    try:
        return hf_config_to_model_config(hf_config)
    except (ValueError, TypeError, ZeroDivisionError) as error:
        raise ValueError(f"{path}: {error}") from None


def _expected_hf_tensors(cfg, config_path: Path, max_gib: float) -> dict:
    """{HF name: shape} of the model `cfg` describes, sized on the meta device (no memory); refuses a model whose
    build would allocate more than `max_gib` GiB (float32 weights plus RoPE tables and causal masks)."""
    from scratchlm.compat.hf import to_hf_state_dict
    from scratchlm.model import TransformerLM

    try:
        sized = TransformerLM(cfg, device="meta")
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
    """{tensor name: (shard, TensorEntry)} over all shards; a name in two shards is an error."""
    from scratchlm.compat.safetensors_header import read_safetensors_header

    declared = {}
    for shard in shards:
        for name, entry in read_safetensors_header(shard).items():
            if name in declared:
                raise ValueError(f"{shard}: tensor {name!r} is also in {declared[name][0]}")
            declared[name] = (shard, entry)
    return declared


def _check_declared(declared: dict, expected: dict, cfg, where: str) -> None:
    """Every expected tensor is declared with its shape and a float dtype; nothing is declared that would be lost."""
    from scratchlm.compat.safetensors_header import FLOAT_DTYPES

    for name, shape in expected.items():
        if name not in declared:
            raise ValueError(f"{where} lack tensor {name!r} that config.json's model needs "
                             f"({len(set(expected) - set(declared))} missing)")
        shard, entry = declared[name]
        if entry.shape != shape:
            raise ValueError(f"{shard}: tensor {name!r} has shape {entry.shape} but config.json implies {shape}")
        if entry.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{shard}: tensor {name!r} is {entry.dtype}; weights must be one of "
                             f"{sorted(FLOAT_DTYPES)}")
    tied_head = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unused = sorted(name for name in set(declared) - set(expected) - tied_head
                    if not name.endswith(_IGNORED_SUFFIXES))
    if unused:
        raise ValueError(f"{declared[unused[0]][0]}: holds {len(unused)} tensors a Llama of this config has no "
                         f"place for, e.g. {unused[:3]} (importing would drop them)")
    if "lm_head.weight" in tied_head & set(declared):
        shard, entry = declared["lm_head.weight"]
        if entry.shape != expected["model.embed_tokens.weight"]:
            raise ValueError(f"{shard}: config.json ties the embeddings but lm_head.weight has shape {entry.shape}, "
                             f"model.embed_tokens.weight {expected['model.embed_tokens.weight']}")


def _check_tied_head(tensors: dict, declared: dict) -> None:
    """tie_word_embeddings with a separate lm_head: fine when it equals the embedding, else the head would be lost."""
    import torch

    head, embedding = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    if not torch.equal(head.float(), embedding.float()):
        raise ValueError(f"config.json sets tie_word_embeddings, but lm_head.weight ({declared['lm_head.weight'][0]}) "
                         f"differs from model.embed_tokens.weight ({declared['model.embed_tokens.weight'][0]}): "
                         f"importing would drop the head; set tie_word_embeddings to false to keep it")


def read_hf_tokenizer(model_dir: Path):
    """Our Tokenizer from the folder's Hugging Face ``tokenizer.json``, or None when it has none.

    Raises ``UnsupportedHFTokenizer`` for a tokenizer our encoder does not match (WordPiece, a normalizer...) and
    a ValueError naming the file for a malformed one (tokenizer/hf_format.py reads it)."""
    from scratchlm.tokenizer import Tokenizer
    from scratchlm.tokenizer.hf_format import HF_TOKENIZER_FILE

    path = model_dir / HF_TOKENIZER_FILE
    return Tokenizer.from_files(path) if path.is_file() else None


def write_run(model, tokenizer, run_dir: Path) -> Path:
    """A run directory (config.toml + a step-0 checkpoint [+ tokenizer/]) holding `model`; returns the checkpoint."""
    from scratchlm.config import DataConfig, RunConfig, TrainConfig
    from scratchlm.optim.adamw import AdamW
    from scratchlm.train.checkpoint import CheckpointManager

    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = None
    if tokenizer is not None:
        tokenizer_dir = run_dir.resolve() / "tokenizer"
        tokenizer.save(tokenizer_dir)
    config = RunConfig(model=model.config, data=DataConfig(tokenizer=str(tokenizer_dir) if tokenizer_dir else None),
                       train=TrainConfig(run_dir=str(run_dir)))
    config.save_toml(run_dir / "config.toml")
    optimizer = AdamW(model.parameters())  # fresh: an imported model has no optimizer state to carry
    return CheckpointManager(run_dir).save(0, model, optimizer, config=config.to_dict(), sampler_state={})
