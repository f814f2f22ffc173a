"""`scratchlm accounting` (what a run costs, before renting a GPU) and `scratchlm bench ops` (op studies).

`accounting` prints, for a preset or a TOML config (with `--set model.key=value` overrides), parameters and
forward FLOPs by component and by matrix, training memory, the KV cache per decoded token, the largest batch for
`--memory`, and the compute and time to train `--tokens` (or `--steps`); `--json` prints the same as one JSON
object (`accounting_report`).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scratchlm.accounting.memory import (
    estimate_memory,
    max_batch_size,
    parse_memory,
    time_to_train,
    training_flops_per_token,
)
from scratchlm.accounting.params_flops import (
    ADAMW_FLOPS_PER_PARAM,
    count_params,
    forward_flops,
    kv_cache_bytes_per_token,
    matrix_table,
    six_n_d_flops,
    training_step_flops,
)
from scratchlm.errors import UserError
from scratchlm.model_args import shape_run_config

ACCOUNTING_EPILOG = """examples:
  scratchlm accounting --preset gpt2-xl --context 1024 --batch 4 --memory 80GB --tflops 989 --mfu 0.4 --tokens 10e9
  scratchlm accounting --preset gpt2-xl --context 16384 --dtype bf16
  scratchlm accounting --preset gpt2-xl --batch 1024 --steps 400000 --tflops 19.5 --mfu 0.5   # CS336 adamwAccounting
  scratchlm accounting --config configs/tinystories-cpu.toml --set model.d_model=768 --json"""


def register(subparsers: argparse._SubParsersAction) -> None:
    acc = subparsers.add_parser("accounting", help="parameters, FLOPs, training memory and time of a model",
                                description="Closed-formula resource accounting for any model config.",
                                epilog=ACCOUNTING_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = acc.add_mutually_exclusive_group()
    source.add_argument("--preset", default="gpt2-small", help="model preset (default: gpt2-small)")
    source.add_argument("--config", type=Path, help="TOML run config whose [model] to account for")
    acc.add_argument("--set", action="append", default=[], dest="overrides", metavar="model.KEY=VALUE",
                     help="override a model field, e.g. model.d_model=768 (repeatable)")
    acc.add_argument("--context", type=int, help="tokens per sequence (default: the model's context_length)")
    acc.add_argument("--batch", type=int, default=1, help="sequences per step (default: 1)")
    acc.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                     help="fp32, or bf16 autocast with fp32 master weights (default: fp32)")
    acc.add_argument("--activations", choices=("scratchlm", "cs336"), default="scratchlm",
                     help="activation model: what our code saves (default) or the CS336 exercise's count")
    acc.add_argument("--memory", help="device memory, e.g. 80GB or 80GiB: report the largest batch that fits")
    acc.add_argument("--tokens", type=float, help="training tokens, for the compute and time to train (e.g. 10e9)")
    acc.add_argument("--steps", type=int, help="training steps of --batch × --context tokens (instead of --tokens)")
    acc.add_argument("--tflops", type=float, help="peak TFLOP/s of the device (e.g. 989 for H100 bf16 dense)")
    acc.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization for --tflops (default 0.4)")
    acc.add_argument("--tokens-per-second", type=float, help="measured throughput instead of --tflops × --mfu")
    acc.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    acc.set_defaults(func=run_accounting_command)

    bench = subparsers.add_parser("bench", help="micro-benchmarks of our modules (op studies)")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    ops = bench_sub.add_parser("ops", help="our ops vs torch's; FLOP share vs wall-time share in one block",
                               description="Time our modules against torch's and split a block's time by op.")
    ops.add_argument("--d-model", type=int, default=512, help="model width (default 512)")
    ops.add_argument("--context", type=int, default=256, help="sequence length (default 256)")
    ops.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    ops.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    ops.add_argument("--repeats", type=int, default=10, help="timed rounds per op, after 1 warm-up round (default 10)")
    ops.add_argument("--threads", type=int, help="torch threads (default: torch's choice; 1 is steadier on a busy box)")
    ops.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    ops.set_defaults(func=run_bench_ops_command)


def accounting_report(config, context: int, batch: int, dtype: str = "fp32", activation_model: str = "scratchlm",
                      memory: str | None = None, tokens: float | None = None, tflops: float | None = None,
                      mfu: float = 0.4, tokens_per_second: float | None = None,
                      steps: int | None = None) -> dict[str, Any]:
    """Everything `scratchlm accounting` shows, as a JSON-ready dict. `steps` means `steps × batch × context`
    training tokens (give it or `tokens`); the time to train needs `tflops` (× `mfu`) or `tokens_per_second`."""
    params, flops = count_params(config), forward_flops(config, context, batch)
    step = training_step_flops(config, context, batch)
    estimate = estimate_memory(config, context, batch, dtype, activation_model)
    report: dict[str, Any] = {
        "model": config.to_dict(), "context": context, "batch": batch, "dtype": dtype,
        "params": {**asdict(params), "total": params.total,
                   "non_embedding": config.non_embedding_params(params.total)},
        "forward_flops": {**asdict(flops), "total": flops.total},
        "forward_flop_shares": flops.shares(),
        "matrices": [{**asdict(row), "param_share": row.params / params.total,
                      "flop_share": row.forward_flops / flops.total} for row in matrix_table(config, context, batch)],
        "training_step_flops": {"forward": step.forward, "backward": step.backward, "optimizer": step.optimizer,
                                "total": step.total, "adamw_flops_per_param": ADAMW_FLOPS_PER_PARAM},
        "memory_bytes": {"activation_model": activation_model, **estimate.breakdown(), "static": estimate.static,
                         "activations": estimate.activation_total, "total": estimate.total},
        "kv_cache_bytes": {"per_token_fp32": kv_cache_bytes_per_token(config, 4),
                           "per_token_bf16": kv_cache_bytes_per_token(config, 2),
                           "batch_context_fp32": batch * context * kv_cache_bytes_per_token(config, 4)},
    }
    if memory is not None:
        available = parse_memory(memory)
        report["max_batch"] = {"memory_bytes": available, **{
            name: max_batch_size(config, context, available, dtype, name) for name in ("scratchlm", "cs336")}}
    if steps is not None and tokens is not None:
        raise ValueError("give --tokens or --steps, not both")
    if steps is not None:
        if steps <= 0:
            raise ValueError(f"--steps must be positive, got {steps}")
        tokens = steps * batch * context
    if tokens is not None:
        if not 0 < tokens < math.inf:  # also refuses nan
            raise ValueError(f"--tokens must be a finite positive number, got {tokens}")
        report["training_compute"] = {
            "tokens": tokens, "steps": steps,
            "exact_flops": tokens * training_flops_per_token(config, context),
            "six_n_d_flops": six_n_d_flops(params.total, tokens),
            "six_n_d_non_embedding_flops": six_n_d_flops(config.non_embedding_params(params.total), tokens)}
    if tokens is not None and (tokens_per_second is not None or tflops is not None):
        timing = time_to_train(config, context, tokens, tokens_per_second=tokens_per_second,
                               peak_tflops=None if tokens_per_second else tflops, mfu=mfu)
        report["time_to_train"] = {"tokens": tokens, "tokens_per_second": timing.tokens_per_second,
                                   "seconds": timing.seconds, "days": timing.days, "years": timing.years,
                                   "basis": "tokens/s" if tokens_per_second else f"{tflops} TFLOP/s x MFU {mfu}"}
    return report


def run_accounting_command(args: argparse.Namespace) -> int:
    preset = None if args.config is not None else args.preset  # --preset has a default; --config wins
    config = shape_run_config(args.config, preset, args.overrides, "accounting").model
    context = args.context if args.context is not None else config.context_length
    if context <= 0 or args.batch <= 0:
        raise UserError(f"--context and --batch must be positive, got {context} and {args.batch}")
    report = accounting_report(config, context, args.batch, args.dtype, args.activations, args.memory,
                               args.tokens, args.tflops, args.mfu, args.tokens_per_second, args.steps)
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _human(value: float, unit: str = "") -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:,.2f} {prefix}{unit}"
    return f"{value:,.0f} {unit}".rstrip()


def format_report(report: dict[str, Any]) -> str:
    params, flops, shares = report["params"], report["forward_flops"], report["forward_flop_shares"]
    model = report["model"]
    lines = [f"model: d_model={model['d_model']} layers={model['num_layers']} heads={model['num_heads']} "
             f"kv_heads={model['num_kv_heads']} head_dim={model['head_dim']} d_ff={model['d_ff']} "
             f"vocab={model['vocab_size']} norm={model['norm']} ffn={model['ffn']} position={model['position']} "
             f"tied={model['tie_embeddings']} qkv_bias={model['qkv_bias']} rope_scaling={model['rope_scaling']}",
             f"step: batch {report['batch']} x context {report['context']}, {report['dtype']}", "",
             f"{'parameters':<20}{'count':>14}{'share':>9}"]
    for name in ("embeddings", "attention", "ffn", "norms", "final_norm", "lm_head"):
        lines.append(f"  {name:<18}{params[name]:>14,}{params[name] / params['total']:>9.2%}")
    lines += [f"  {'total':<18}{params['total']:>14,}  ({_human(params['total'])})",
              f"  {'non-embedding':<18}{params['non_embedding']:>14,}  (total less the untied input embeddings)", "",
              f"{'forward FLOPs':<20}{'FLOPs':>14}{'share':>9}"]
    for name, share in shares.items():
        lines.append(f"  {name:<18}{_human(flops[name]):>14}{share:>9.2%}")
    step = report["training_step_flops"]
    lines += [f"  {'total':<18}{_human(flops['total']):>14}",
              f"  training step ≈ 3 × forward + AdamW ({step['adamw_flops_per_param']} FLOPs/param): "
              f"{_human(step['total'], 'FLOPs')}", "", *format_matrices(report["matrices"]), "",
              f"memory ({report['memory_bytes']['activation_model']} activation model){'':<2}{'bytes':>12}"]
    skipped = {"activation_model", "static", "activations", "total"}
    for name, value in report["memory_bytes"].items():
        if name not in skipped and value:
            lines.append(f"  {name:<32}{_human(value, 'B'):>12}")
    memory = report["memory_bytes"]
    lines.append(f"  {'total':<32}{_human(memory['total'], 'B'):>12}  (static {_human(memory['static'], 'B')}, "
                 f"activations {_human(memory['activations'], 'B')})")
    kv = report["kv_cache_bytes"]
    lines += ["", f"KV cache when decoding: {_human(kv['per_token_fp32'], 'B')} per token in fp32 "
                  f"({_human(kv['per_token_bf16'], 'B')} in bf16), {_human(kv['batch_context_fp32'], 'B')} for "
                  f"{report['batch']} × {report['context']} tokens"]
    if "max_batch" in report:
        fit = report["max_batch"]
        lines += ["", f"largest batch in {_human(fit['memory_bytes'], 'B')}: {fit['scratchlm']} (what our code "
                      f"saves), {fit['cs336']} (CS336 exercise count)"]
    if "training_compute" in report:
        c = report["training_compute"]
        steps = f" ({c['steps']:,} steps of {report['batch']} × {report['context']})" if c["steps"] else ""
        lines += ["", f"training compute for {_human(c['tokens'])} tokens{steps}:",
                  f"  {c['exact_flops']:.3e} FLOPs exactly (3 × forward); 6·N·D = {c['six_n_d_flops']:.3e} "
                  f"(× {c['six_n_d_flops'] / c['exact_flops']:.3f}), with non-embedding N "
                  f"{c['six_n_d_non_embedding_flops']:.3e}"]
    if "time_to_train" in report:
        t = report["time_to_train"]
        lines += [f"time to train at {_human(t['tokens_per_second'])} tokens/s ({t['basis']}): "
                  f"{t['seconds'] / 3600:,.1f} h = {t['days']:,.2f} days = {t['years']:,.3f} years"]
    return "\n".join(lines)


def format_matrices(rows: list[dict[str, Any]]) -> list[str]:
    """The per-matrix table: every weight matrix and matmul (all layers; ×L marks the per-layer ones)."""
    lines = [f"{'matrix / matmul':<17}{'shape':<26}{'params':>15}{'share':>8}{'forward FLOPs':>15}{'share':>8}"]
    for row in rows:
        name = f"{row['name']} ×L" if row["per_layer"] else row["name"]
        lines.append(f"  {name:<15}{row['shape']:<26}{row['params']:>15,}{row['param_share']:>8.2%}"
                     f"{_human(row['forward_flops']):>15}{row['flop_share']:>8.2%}")
    return lines


def run_bench_ops_command(args: argparse.Namespace) -> int:
    import torch

    from scratchlm.accounting.op_study import OpStudyConfig, format_study, run_op_study

    if args.threads is not None:
        if args.threads <= 0:
            raise ValueError(f"--threads must be positive, got {args.threads}")
        torch.set_num_threads(args.threads)
    study = run_op_study(OpStudyConfig(d_model=args.d_model, context=args.context, batch=args.batch,
                                       num_heads=args.heads, repeats=args.repeats))
    print(json.dumps(study, indent=2) if args.json else format_study(study))
    return 0
