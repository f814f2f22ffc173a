"""`scratchlm sweep` (grid sweeps, resumable, shardable) and `scratchlm report` (HTML + Markdown run reports)."""

from __future__ import annotations

import argparse
from pathlib import Path

from scratchlm.output_paths import refuse_foreign_folder, refuse_inputs, removed_on_failure

SWEEP_EPILOG = """examples:
  scratchlm sweep --config configs/tinystories-cpu.toml --grid optim.lr=1e-4,3e-4,1e-3,3e-3 --out runs/lr
  scratchlm sweep --config base.toml --grid optim.lr=1e-3,3e-3 --grid data.batch_size=16,64 --set train.max_steps=300
  CUDA_VISIBLE_DEVICES=1 scratchlm sweep ... --shard 1/4     # one process per GPU, points 1, 5, 9, ...
Rerunning the same command resumes: finished and diverged points are skipped, interrupted ones resume."""


def register(subparsers: argparse._SubParsersAction) -> None:
    sweep = subparsers.add_parser("sweep", help="train every point of a grid of config overrides (resumable)",
                                  description="Train one run per combination of --grid values.", epilog=SWEEP_EPILOG,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    sweep.add_argument("--config", required=True, type=Path, help="base TOML config every point starts from")
    sweep.add_argument("--grid", action="append", required=True, metavar="SECTION.KEY=V1,V2,...",
                       help="values to try for one config key (repeat for a cartesian product)")
    sweep.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="overrides",
                       help="override applied to every point, e.g. train.max_steps=300")
    sweep.add_argument("--out", type=Path, default=Path("runs/sweep"), help="sweep directory (default: runs/sweep)")
    sweep.add_argument("--shard", default="0/1", metavar="I/N", help="train only points I, I+N, ... (0-based)")
    sweep.add_argument("--quiet", action="store_true", help="no progress bars")
    sweep.add_argument("--force", action="store_true", help="use an --out folder that holds files but no sweep")
    sweep.set_defaults(func=run_sweep_command)

    report = subparsers.add_parser("report", help="compare runs: self-contained HTML + Markdown report",
                                   description="Learning curves, final losses and config diffs of runs vs a baseline.")
    report.add_argument("runs", nargs="+", type=Path, metavar="RUN_DIR",
                        help="run directories (a sweep directory stands for all of its points)")
    report.add_argument("--baseline", type=Path, help="run to compare against (default: the first)")
    report.add_argument("--out", type=Path, help="output directory (default: report/ inside the first RUN_DIR)")
    report.add_argument("--title", default="scratchlm runs", help="report title")
    report.add_argument("--force", action="store_true", help="write into an --out folder that holds other files")
    report.set_defaults(func=run_report_command)


def run_sweep_command(args: argparse.Namespace) -> int:
    from scratchlm.experiments.sweep import SUMMARY_FILE, SweepSpec, parse_axis, parse_shard, run_sweep

    spec = SweepSpec(base_config=args.config, axes=[parse_axis(g) for g in args.grid], out_dir=args.out,
                     overrides=list(args.overrides), shard=parse_shard(args.shard))
    refuse_inputs(args.out, [args.config])
    refuse_foreign_folder(args.out, force=args.force, ours=(SUMMARY_FILE,))  # a sweep folder: rerun = resume
    with removed_on_failure(args.out, keep_results=True):
        summary = run_sweep(spec, quiet=args.quiet)
    width = max(len(p["name"]) for p in summary["points"])
    print(f"\n{'point':<{width}}  {'status':<11}  final val loss")
    for point in summary["points"]:
        loss = point.get("final_val_loss")
        print(f"{point['name']:<{width}}  {point['status']:<11}  {'—' if loss is None else f'{loss:.4f}'}")
    print(f"best: {summary['best'] or '—'}\nsummary: {args.out / 'sweep.json'}\n"
          f"report:  scratchlm report {args.out}")
    index, count = spec.shard
    pending = [p for p in summary["points"][index::count] if p["status"] not in ("finished", "diverged")]
    return 1 if pending else 0


REPORT_FILES = ("report.html", "report.md")


def expand_run_dirs(paths: list[Path]) -> list[Path]:
    """Run directories as given, except that a sweep directory (with sweep.json) becomes its points' runs."""
    from scratchlm.experiments.sweep import is_sweep_dir, read_summary

    expanded = []
    for path in paths:
        if is_sweep_dir(path):
            expanded += [path / p["run_dir"] for p in read_summary(path)["points"] if p["status"] != "new"]
        else:
            expanded.append(path)
    return expanded


def run_report_command(args: argparse.Namespace) -> int:
    from scratchlm.experiments.report import write_report
    from scratchlm.experiments.sweep import is_sweep_dir

    runs = expand_run_dirs(args.runs)
    if not runs:
        raise ValueError(f"no runs with metrics found in {', '.join(map(str, args.runs))}")
    out = args.out or args.runs[0] / "report"
    # The default report/ lies inside the first run: fine, the report only adds its own names there.
    refuse_inputs(out, [*args.runs, *runs], inside_ok=True)
    refuse_foreign_folder(out, force=args.force, ours=REPORT_FILES)  # an earlier report is replaced
    with removed_on_failure(out):
        html_path, md_path = write_report(runs, out_dir=out, baseline=args.baseline, title=args.title,
                                          sweeps=[path for path in args.runs if is_sweep_dir(path)])
    print(f"report: {html_path}\n        {md_path}")
    return 0
