"""`scratchlm train` (a run from a TOML config) and `scratchlm eval` (loss and perplexity of a checkpoint).

The flags here are only the handful people change per invocation; everything else is a config field reached
with ``--set section.key=value``. ``--device``, ``--compile``, ``--run-dir``, ``--budget`` and ``--init-from`` are
shorthands that become ``--set`` overrides, so there is exactly one override path (config.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from scratchlm.model_args import add_cs336_checkpoint_arguments, load_model_for_command
from scratchlm.paths import DEFAULT_RECIPE

TRAIN_EPILOG = """examples:
  scratchlm train --config configs/tiny.toml --set data.train_path=train.tok --set data.val_path=valid.tok
  scratchlm train --config configs/tinystories-cpu.toml --set optim.lr=3e-3 --run-dir runs/lr3e-3
  scratchlm train --run-dir runs/lr3e-3 --resume          # continue from the newest valid checkpoint
  scratchlm train --run-dir moved/run --resume --set data.train_path=t.tok --set data.val_path=v.tok  # moved run
  scratchlm train --config configs/recipes/modern.toml --budget 25m   # the best model 25 minutes buy here
  scratchlm train --config configs/recipes/modern.toml --init-from base --budget 10m \
      --set data.train_path=train.tok --set data.val_path=train.val.tok   # fine-tune the weights of run `base`
exit status: 0 finished, 1 diverged or bad input, 130 interrupted (a checkpoint was saved)."""

EXIT_CODES = {"finished": 0, "diverged": 1, "interrupted": 130}


def register(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser("train", help="train a model from a TOML config (resumable)",
                                  description="Train a TransformerLM; writes checkpoints, metrics.jsonl, curves.png "
                                              "and the resolved config.toml to the run directory.",
                                  epilog=TRAIN_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_arguments(train)
    train.set_defaults(func=run_train)

    plan = subparsers.add_parser("plan", help="suggest a model shape and step count for a time budget",
                                 description="Measure this machine's training throughput on a recipe and rank model "
                                             "shapes for a time budget by predicted loss (compute-optimal, aware "
                                             "that a small corpus is repeated: accounting/sizing.py); prints the "
                                             "best as --set overrides for `scratchlm train --budget`.")
    plan.add_argument("--budget", required=True, metavar="DURATION", help="time budget: 25m, 1.5h, 900s, 900")
    plan.add_argument("--data", required=True, type=Path, help="training token file (its size sets the epochs)")
    plan.add_argument("--config", type=Path, default=DEFAULT_RECIPE,
                      help=f"recipe to size (default: {DEFAULT_RECIPE.relative_to(DEFAULT_RECIPE.parents[2])})")
    plan.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                      help="override a config field before sizing (repeatable)")
    plan.add_argument("--device", help="shorthand for --set train.device=D")
    plan.add_argument("--top", type=int, default=8, help="how many shapes to list (default: 8)")
    plan.set_defaults(func=run_plan)

    evaluate = subparsers.add_parser("eval", help="loss, perplexity and bits per byte of a checkpoint on a token file",
                                     description="Evaluate a checkpoint (or a run's newest valid one) on any token "
                                                 "file written by `scratchlm data encode`: loss (nats/token), "
                                                 "perplexity, and bits per byte when the run's tokenizer is known "
                                                 "(comparable across tokenizers). With --continuations: the "
                                                 "log-likelihood of each continuation given its context, as "
                                                 "lm-evaluation-harness computes it.")
    evaluate.add_argument("--checkpoint", type=Path, help="run directory or checkpoint directory")
    what = evaluate.add_mutually_exclusive_group(required=True)
    what.add_argument("--data", type=Path, help="token file to evaluate on")
    what.add_argument("--continuations", type=Path, metavar="FILE.jsonl",
                      help='JSON Lines of {"context": str, "continuation": str}: print each continuation\'s '
                           "log-likelihood and whether it is the greedy one")
    evaluate.add_argument("--out", type=Path, metavar="FILE.jsonl",
                          help="with --continuations: also write the scores, one JSON object a request")
    evaluate.add_argument("--window", type=int, metavar="TOKENS",
                          help="with --continuations: the model reads at most TOKENS tokens of context + "
                               "continuation (default: its context_length, as lm_eval's hf model; lm_eval's "
                               "local-completions against `scratchlm serve` reads context_length - 1)")
    evaluate.add_argument("--batches", type=int, help="evaluate only the first N batches (default: whole file)")
    evaluate.add_argument("--batch-size", type=int, default=8, help="sequences per batch (default: 8)")
    evaluate.add_argument("--device", default="auto", help="auto (default), cpu, cuda, cuda:N, mps")
    evaluate.add_argument("--tokenizer", type=Path, help="tokenizer directory for bits per byte and --continuations "
                                                         "(default: the run's copy, RUN/tokenizer, else its "
                                                         "data.tokenizer)")
    add_cs336_checkpoint_arguments(evaluate)  # --cs336-checkpoint FILE + its shape, to compare a course model
    evaluate.set_defaults(func=run_eval)


def add_run_arguments(parser: argparse.ArgumentParser, *, config_default: str = "") -> None:
    """The options of a training run, shared by `train` and `finetune`: --config, --set and their shorthands."""
    parser.add_argument("--config", type=Path,
                        help=f"TOML config (default with --resume: RUN_DIR/config.toml{config_default})")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                        help="override a config field, e.g. optim.lr=3e-3 (repeatable)")
    parser.add_argument("--resume", action="store_true", help="continue from the run's newest valid checkpoint")
    parser.add_argument("--device", help="shorthand for --set train.device=D (auto, cpu, cuda, cuda:N, mps)")
    parser.add_argument("--compile", action="store_true", help="shorthand for --set train.compile=true")
    parser.add_argument("--run-dir", help="shorthand for --set train.run_dir=DIR")
    parser.add_argument("--budget", metavar="DURATION",
                        help="train for a time budget (25m, 1.5h, 900s, 900): the steps are planned from a measured "
                             "step; shorthand for --set train.budget_seconds=SECONDS")
    parser.add_argument("--init-from", metavar="PATH",
                        help="start from the weights, model config and tokenizer of a run, a checkpoint or a Hugging "
                             "Face model folder, with a fresh optimizer, schedule and budget (the config's [model] "
                             "table is not used); shorthand for --set train.init_from=PATH")
    parser.add_argument("--force-memory", action="store_true",
                        help="train even when the memory estimate (parameters, gradients, optimizer state and "
                             "activations, as `scratchlm accounting` counts them) exceeds the free memory: the "
                             "estimate can be pessimistic; at your own risk")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or log lines")


def train_overrides(args: argparse.Namespace) -> list[str]:
    """The --set list with the shorthand flags appended (they win over earlier --set of the same key)."""
    overrides = list(args.overrides)
    if args.device:
        overrides.append(f"train.device={args.device}")
    if args.compile:
        overrides.append("train.compile=true")
    if args.run_dir:
        overrides.append(f"train.run_dir={args.run_dir}")
    if args.budget is not None:
        from scratchlm.train.budget import parse_duration

        overrides.append(f"train.budget_seconds={parse_duration(args.budget)}")
    if args.init_from:
        overrides.append(f"train.init_from={args.init_from}")
    return overrides


def run_train(args: argparse.Namespace, *, command: str = "train", default_config: Path | None = None,
              extra_overrides: Sequence[str] = (), read_data: Callable[..., Any] | None = None) -> int:
    """`scratchlm train`, and the same run for `scratchlm finetune`: its ``default_config`` when --config is not
    given, its ``extra_overrides`` (before --set's), and ``read_data(config, quiet=...)``: the examples it trains on
    instead of token files, read and checked before anything is written."""
    from scratchlm.config import load_config, stated_values
    from scratchlm.errors import UserError
    from scratchlm.train import distributed
    from scratchlm.train.trainer import CONFIG_FILE, train

    saved = None  # the run's own config.toml, when it is what this resume continues from: read here, once
    overrides = [*extra_overrides, *train_overrides(args)]
    if args.config is None and args.resume and args.run_dir:
        saved_path = Path(args.run_dir) / CONFIG_FILE
        saved = load_config(saved_path)
        config = saved.with_overrides(overrides, saved_path)
    elif args.config is None and default_config is None:
        raise UserError("--config is required (or --resume --run-dir RUN to continue a run from RUN/config.toml)")
    else:
        config = load_config(args.config or default_config, overrides)
    _refuse_overwriting_config(args.config, Path(config.train.run_dir) / CONFIG_FILE)
    data = read_data(config, quiet=args.quiet) if read_data is not None else None
    # Under torchrun: process group, this rank's device and the DDP/FSDP2 wrap; otherwise a pass-through.
    with distributed.launch(config) as launched:
        quiet = args.quiet or not launched.is_main
        result = train(config, resume=args.resume, quiet=quiet, wrap=launched.wrap, device=launched.device,
                       model_overrides=stated_values(args.overrides, "model"),  # what --init-from checks
                       force_memory=args.force_memory, saved=saved, data=data)
    if result.status != "finished":
        print(f"scratchlm {command}: {result.status}: {result.message}", file=sys.stderr)
    elif not quiet:
        val = f", best val loss {result.best_val_loss:.4f}" if result.best_val_loss is not None else ""
        print(f"finished {result.final_step} steps: train loss {result.train_loss:.4f}{val} -> {result.run_dir}",
              file=sys.stderr)
    return EXIT_CODES[result.status]


def _refuse_overwriting_config(given: Path | None, saved: Path) -> None:
    """The run saves its resolved config as RUN/config.toml: that must not be the user's own (commented) file."""
    from scratchlm.config import is_resolved_config
    from scratchlm.errors import UserError
    from scratchlm.output_paths import same_path

    if given is not None and saved.exists() and same_path(given, saved) and not is_resolved_config(given):
        raise UserError(f"--config {given} is the run directory's config.toml, which train replaces with the "
                        f"resolved config: keep your config outside the run directory, or choose another --run-dir")


def run_plan(args: argparse.Namespace) -> int:
    from scratchlm.accounting.sizing import rank_shapes
    from scratchlm.config import load_config
    from scratchlm.data.token_file import open_token_file
    from scratchlm.errors import UserError
    from scratchlm.train.allocator import keep_freed_memory
    from scratchlm.train.budget import PLANNED_SHARE, choose_threads, parse_duration
    from scratchlm.train.precision import choose_dtype
    from scratchlm.train.setup import check_data, select_device
    from scratchlm.train.trainer import model_step_flops

    if args.top < 1:
        raise UserError(f"--top must be at least 1, got {args.top}")
    budget = parse_duration(args.budget)
    if not args.config.is_file():
        raise UserError(f"recipe {args.config} not found: pass --config FILE")
    data = open_token_file(args.data)
    config = load_config(args.config, [*args.overrides, *([f"train.device={args.device}"] if args.device else [])])
    config = config.with_values(data={"train_path": str(args.data), "val_path": "", "tokenizer": None},
                                model={"vocab_size": data.vocab_size})
    train_tokens, _ = check_data(config, data, None, None)  # as train checks them (the ids, one window)
    keep_freed_memory()  # as `train` does on a CPU (allocator.py), so the probe measures the speed train gets
    if config.train.dtype == "auto":  # as `train` resolves it (precision.py): the speed it will train at
        dtype, why = choose_dtype(select_device(config.train.device))
        config = config.with_values(train={"dtype": dtype})
        print(why)
    threads, step_seconds = choose_threads(config, train_tokens)
    model = config.model
    step_flops = model_step_flops(config)
    flops_per_second = step_flops / step_seconds
    seconds = PLANNED_SHARE * budget
    ranked = rank_shapes(model, flops_per_second, seconds, len(data.tokens), config.data.batch_size)
    print(f"probe: {args.config.name} (d_model={model.d_model}, {model.num_layers} layers) takes {step_seconds:.3f} s "
          f"a step with {threads} thread{'s' * (threads > 1)} here: {flops_per_second / 1e9:.1f} GFLOP/s of training; "
          f"{seconds:.0f} s of training buy {flops_per_second * seconds:.3g} FLOPs; the data holds "
          f"{len(data.tokens):,} tokens")
    print("| d_model | layers | heads | d_ff | non-emb. params | tokens | epochs | steps | predicted loss |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    tokens_per_step = config.tokens_per_step
    for c in ranked[:args.top]:
        print(f"| {c.model.d_model} | {c.model.num_layers} | {c.model.num_heads} | {c.model.d_ff} | "
              f"{c.non_embedding_params / 1e6:.2f}M | {c.tokens / 1e6:.1f}M | {c.epochs:.1f} | "
              f"{int(c.tokens / tokens_per_step):,} | {c.predicted_loss:.3f} |")
    best = ranked[0].model
    shape_keys = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff")
    diff = " ".join(f"--set model.{key}={getattr(best, key)}" for key in shape_keys
                    if getattr(best, key) != getattr(model, key))
    print(f"\nbest: scratchlm train --config {args.config} --budget {args.budget} {diff or '(the recipe as it is)'}")
    return 0


def run_eval(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.data.token_file import open_token_file
    from scratchlm.errors import UserError
    from scratchlm.model import kernels
    from scratchlm.train.bits_per_byte import bits_per_byte, token_byte_lengths
    from scratchlm.train.loss import perplexity
    from scratchlm.train.setup import select_device
    from scratchlm.train.step import evaluate

    if args.batch_size < 1 or (args.batches is not None and args.batches < 1):
        raise UserError("--batch-size and --batches must be positive")
    if args.out is not None and args.continuations is None:
        raise UserError("--out writes the scores of --continuations")
    if args.window is not None and args.continuations is None:
        raise UserError("--window is the model's window over --continuations")
    device = select_device(args.device)
    model, config = load_model_for_command(args, device=device)
    kernels.apply(model, device)  # the speed paths the trainer runs (model/kernels/), equal to the readable ones
    if args.continuations is not None:
        return _eval_continuations(args, model, config, device)
    model.check_inputs = False  # the token file is checked against the vocabulary below
    # The run's tokenizer hash (tokenizer_identity.py): a file encoded with another tokenizer is refused.
    tokens = open_token_file(args.data, vocab_size=config.model.vocab_size,
                             tokenizer_hash=config.data.tokenizer_hash).tokens
    context = config.model.context_length
    if len(tokens) < context + 1:
        raise UserError(f"{args.data} holds {len(tokens)} tokens, fewer than context_length + 1 = {context + 1}")
    tokenizer = _eval_tokenizer(args, config)
    bits = ""
    with torch.inference_mode():
        if tokenizer is None:
            config = config.with_values(data={"batch_size": args.batch_size},
                                        train={"grad_accum_steps": 1, "dtype": "fp32"})
            loss = evaluate(model, tokens, config, device, max_batches=args.batches)
        else:  # the same windows as evaluate's (validation_batches), so the loss is the same number
            windows = (len(tokens) - 1) // context
            if args.batches is not None:
                windows = min(windows, args.batches * args.batch_size)
            scored = bits_per_byte(model, tokens, token_byte_lengths(tokenizer), context, windows * context,
                                   batch_size=args.batch_size, device=device)
            loss, bits = scored.nats_per_token, f"  bits/byte {scored.bits_per_byte:.4f}"
    print(f"loss {loss:.4f}  perplexity {perplexity(loss):.3f}{bits}  ({args.data})")
    return 0


def _eval_continuations(args: argparse.Namespace, model, config, device) -> int:
    import json

    import torch

    from scratchlm.errors import UserError
    from scratchlm.output_paths import refuse_inputs
    from scratchlm.train.loglikelihood import read_requests, score_requests
    from scratchlm.train.tokenizer_identity import tokenizer_for_run
    from scratchlm.write_errors import naming

    context = config.model.context_length
    window = context if args.window is None else args.window
    if not 1 <= window <= context:
        raise UserError(f"--window must be in [1, {context}] (the model's context_length), got {window}")
    if args.out is not None:
        refuse_inputs(args.out, [args.continuations])
        if args.out.exists():  # it may be anyone's file: scores go to a new one
            raise UserError(f"--out {args.out} exists: choose a new file (eval never overwrites one)")
    requests = read_requests(args.continuations)
    tokenizer = tokenizer_for_run(args.checkpoint or args.cs336_checkpoint, config, args.tokenizer)
    with torch.inference_mode():
        scores = score_requests(model, tokenizer, requests, window, source=args.continuations,
                                batch_size=args.batch_size, device=device)
    records = [{"line": request.line, "loglikelihood": score.loglikelihood, "is_greedy": score.is_greedy,
                "tokens": score.tokens} for request, score in zip(requests, scores)]
    for record in records:
        print(f"line {record['line']}: log-likelihood {record['loglikelihood']:.6f} over {record['tokens']} "
              f"tokens{', greedy' if record['is_greedy'] else ''}")
    greedy = sum(score.is_greedy for score in scores)
    print(f"{len(scores)} continuations, {greedy} greedy  ({args.continuations})")
    if args.out is not None:
        with naming(args.out):  # a full disk names the file
            args.out.write_text("".join(json.dumps(record) + "\n" for record in records), encoding="utf-8")
    return 0


def _eval_tokenizer(args: argparse.Namespace, config):
    """The tokenizer bits per byte needs: --tokenizer (errors are errors), else the run's own (none known, or not
    found: a note on stderr, and eval reports loss and perplexity alone)."""
    from scratchlm.errors import UserError
    from scratchlm.train.tokenizer_identity import tokenizer_for_run

    checkpoint = args.checkpoint or args.cs336_checkpoint
    if args.tokenizer is not None:
        return tokenizer_for_run(checkpoint, config, args.tokenizer)
    try:
        return tokenizer_for_run(checkpoint, config, None)
    except UserError as error:
        print(f"scratchlm eval: note: no bits per byte ({error})", file=sys.stderr)
        return None
