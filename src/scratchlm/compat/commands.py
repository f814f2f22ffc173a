"""`scratchlm export hf|gguf` and `scratchlm import hf|gguf`: trade checkpoints with Hugging Face and llama.cpp.

Export writes a folder that `transformers.AutoModelForCausalLM` and `AutoTokenizer` load offline, in the
architecture compat/hf_export.py chooses (Llama, Qwen2, Qwen3, or custom code), and prints which one and why.
Import reads a Llama, Mistral, Qwen2 or Qwen3 folder (compat/hf_import.py; anything it cannot run exactly is
refused naming the field) into a run directory that `generate` and `eval` accept: ``config.toml``, a step-0
checkpoint written by the checkpoint module, and ``tokenizer/`` when the folder has a byte-level BPE tokenizer
that our encoder matches (another kind is left out, saying why).
`export gguf` writes one GGUF file for llama.cpp (compat/gguf_export.py); `import gguf` reads one back
(compat/gguf_import.py) into a run directory the same way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from scratchlm.compat.gguf_export import GGUF_TYPES
from scratchlm.compat.hf_import import DEFAULT_MAX_GIB, HF_PACKAGES
from scratchlm.config import DTYPES, TORCH_DTYPE_NAMES


def register(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser("export", help="export a checkpoint to another format",
                                   description="Export a checkpoint to another ecosystem.")
    export_formats = export.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = export_formats.add_parser("hf", help="Hugging Face transformers folder (Llama, Qwen2, Qwen3 or custom code)",
                                   description="Write config.json + model.safetensors + tokenizer files that "
                                               "transformers' AutoModelForCausalLM / AutoTokenizer load offline, "
                                               "as the first of Llama, Qwen2 and Qwen3 that expresses the model "
                                               "exactly, else as custom code (trust_remote_code=True).")
    gguf = export_formats.add_parser("gguf", help="one GGUF file for llama.cpp / ollama (llama, Qwen2, Qwen3)",
                                     description="Write the model and its tokenizer as one GGUF file that llama.cpp "
                                                 "loads, in the architecture `export hf` would choose (llama, qwen2 "
                                                 "or qwen3); a model llama.cpp cannot run is refused.")
    exports = ((hf, "output folder", "write into an existing folder that holds files", run_export_hf),
               (gguf, "the .gguf file to write", "replace an existing file", run_export_gguf))
    for parser, out, force, handler in exports:
        parser.add_argument("--checkpoint", required=True, type=Path, help="run directory or checkpoint directory")
        parser.add_argument("--out", required=True, type=Path, help=out)
        parser.add_argument("--tokenizer", type=Path,
                            help="tokenizer directory (default: the run's copy, RUN/tokenizer)")
        parser.add_argument("--force", action="store_true", help=force)
        parser.set_defaults(func=handler)
    hf.add_argument("--push-to-hub", metavar="OWNER/NAME",
                    help="then upload the folder to this Hugging Face model repository, created when missing (token: "
                         "HF_TOKEN or `hf auth login`; needs the [hub] extra)")
    hf.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    gguf.add_argument("--type", choices=GGUF_TYPES, default="f32", dest="gguf_type",
                      help="weight type: f32 (default, exact), f16, or q8_0 (2-D weights quantised as llama.cpp "
                           "does; norms and biases stay f32)")

    imp = subparsers.add_parser("import", help="import a checkpoint from another format",
                                description="Import a model from another ecosystem as a scratchlm run directory.")
    import_formats = imp.add_subparsers(dest="format", metavar="FORMAT", required=True)
    hf = import_formats.add_parser("hf", help="Hugging Face Llama / Mistral / Qwen2 / Qwen3 folder (safetensors)",
                                   description="Read a Llama, Mistral, Qwen2 or Qwen3 folder (config.json + "
                                               "*.safetensors [+ tokenizer.json]) into a run directory.")
    hf.add_argument("--model", required=True, type=Path, help="Hugging Face model folder")
    gguf = import_formats.add_parser("gguf", help="GGUF file (llama.cpp's llama, qwen2, qwen3; f32/f16/bf16/q8_0)",
                                     description="Read a GGUF file of llama.cpp's llama, qwen2 or qwen3 architecture "
                                                 "(weights f32, f16, bf16 or q8_0, dequantised) into a run directory.")
    gguf.add_argument("file", type=Path, help="the .gguf file")
    for parser, source, handler in ((hf, "config.json", run_import_hf), (gguf, "file", run_import_gguf)):
        parser.add_argument("--out", required=True, type=Path, help="run directory to create")
        parser.add_argument("--max-gib", type=float, default=DEFAULT_MAX_GIB,
                            help=f"refuse a {source} whose model would allocate more than this many GiB before its "
                                 f"weights are read (default {DEFAULT_MAX_GIB:g})")
        parser.add_argument("--dtype", choices=DTYPES, default="fp32",
                            help="build the model and store its weights in this dtype (default fp32; bf16/fp16 "
                                 "weights widen to it exactly)")
        parser.add_argument("--force", action="store_true", help="write into an existing folder that holds files")
        parser.set_defaults(func=handler)

# ---------------------------------------------------------------------------------------------------- export

def run_export_hf(args: argparse.Namespace) -> int:
    from scratchlm.compat.hf_export import export_hf
    from scratchlm.errors import UserError
    from scratchlm.extras import require
    from scratchlm.hub import push_folder, require_hub
    from scratchlm.output_paths import refuse_foreign_folder, removed_on_failure

    for package in HF_PACKAGES:  # checked first: one line naming the extra, not a traceback halfway through
        require(package, "hf", "scratchlm export hf")
    if args.private and not args.push_to_hub:
        raise UserError("--private is for --push-to-hub (the visibility of the repository it creates)")
    if args.push_to_hub:
        require_hub("scratchlm export hf --push-to-hub")
    model, _, tokenizer = _model_to_export(args, refuse_foreign_folder)
    with removed_on_failure(args.out):
        why = export_hf(model, tokenizer, args.out)
    print(f"architecture {why}")
    print(f"wrote {args.out}/: {', '.join(sorted(p.name for p in args.out.iterdir()))}")
    if args.push_to_hub:  # after the export, which stays on disk if the upload fails
        print(f"pushed {args.out}/ to {push_folder(args.out, args.push_to_hub, private=args.private)}")
    return 0


def run_export_gguf(args: argparse.Namespace) -> int:
    from scratchlm.compat.gguf_export import export_gguf
    from scratchlm.extras import require
    from scratchlm.output_paths import refuse_file, removed_on_failure

    require("gguf", "gguf", "scratchlm export gguf")
    model, config, tokenizer = _model_to_export(args, refuse_file)
    name = Path(config.train.run_dir).name if config.train.run_dir else args.checkpoint.resolve().name
    with removed_on_failure(args.out.parent):  # the folders made for it, when the export fails
        args.out.parent.mkdir(parents=True, exist_ok=True)
        plan = export_gguf(model, tokenizer, args.out, args.gguf_type, name=name, run=str(args.checkpoint))
    print(f"architecture {plan.why}")
    for note in plan.notes:
        print(f"note: {note}")
    print(f"wrote {args.out} ({args.gguf_type}, {args.out.stat().st_size:,} bytes)")
    return 0


def _model_to_export(args: argparse.Namespace, refuse_existing) -> tuple:
    """(model, RunConfig, tokenizer) of --checkpoint and --tokenizer, once --out is known to overwrite neither
    (nor, by `refuse_existing`, anything else without --force)."""
    from scratchlm.output_paths import refuse_inputs
    from scratchlm.train.checkpoint import load_for_inference
    from scratchlm.train.tokenizer_identity import tokenizer_for_run

    refuse_inputs(args.out, [args.checkpoint, *([args.tokenizer] if args.tokenizer else [])])
    refuse_existing(args.out, force=args.force)
    model, config = load_for_inference(args.checkpoint)
    return model, config, tokenizer_for_run(args.checkpoint, config, args.tokenizer)  # refuses another tokenizer


# ---------------------------------------------------------------------------------------------------- import

def run_import_hf(args: argparse.Namespace) -> int:
    from scratchlm.compat.hf_import import read_hf_folder
    from scratchlm.extras import require

    for package in HF_PACKAGES:
        require(package, "hf", "scratchlm import hf")
    if not (args.model / "config.json").is_file():
        raise FileNotFoundError(f"{args.model} is not a Hugging Face model folder (no config.json)")
    return _import_run(args, args.model, read_hf_folder)


def run_import_gguf(args: argparse.Namespace) -> int:
    from scratchlm.compat.gguf_import import read_gguf
    from scratchlm.extras import require

    require("gguf", "gguf", "scratchlm import gguf")
    return _import_run(args, args.file, read_gguf)


def _import_run(args: argparse.Namespace, source: Path, read) -> int:
    """Read `source` with `read` (read_hf_folder or read_gguf) and write it as the run directory --out."""
    import torch

    from scratchlm.errors import UserError
    from scratchlm.output_paths import refuse_foreign_folder, refuse_inputs, removed_on_failure

    refuse_inputs(args.out, [source])
    if (args.out / "checkpoints").exists():
        raise UserError(f"{args.out} already holds a run (checkpoints/); choose a new --out")
    refuse_foreign_folder(args.out, force=args.force)
    model, tokenizer, missing = read(source, max_gib=args.max_gib, dtype=getattr(torch, TORCH_DTYPE_NAMES[args.dtype]))
    with removed_on_failure(args.out):
        checkpoint = write_run(model, tokenizer, args.out)
    note = "" if tokenizer else f" ({missing}; pass --tokenizer to generate)"
    print(f"wrote run directory {args.out} with checkpoint {checkpoint}{note}")
    return 0


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
