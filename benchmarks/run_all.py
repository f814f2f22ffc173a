"""Run every side-by-side benchmark, one at a time, and write their output to one Markdown file.

    .venv/bin/python benchmarks/run_all.py            # full runs (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # short runs, noisier figures
    .venv/bin/python benchmarks/run_all.py --only bench_encode bench_model
    .venv/bin/python benchmarks/run_all.py --only bench_quality   # on request only: ~20 min (3 x 5 min training)
    .venv/bin/python benchmarks/run_all.py --out runs/benchmarks/today.md

Each benchmark is a script `benchmarks/bench_*.py` that prints Markdown tables; this runner executes them one at a
time (so they do not compete for the cores) and writes each script's output under the exact command that produced
it, the date and the machine, to `--out` (default: runs/benchmarks/run_all-DATE-TIME.md). docs/benchmarks.md is a
reference, one current table per benchmark, updated by hand from such a record taken on a quiet machine.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness import machine_line

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
RECORDS = ROOT / "runs" / "benchmarks"
# Too long for the routine list (bench_quality trains three models for 5 minutes each): run only when named in --only.
ON_REQUEST = {"bench_quality"}


def machine_description() -> str:
    return f"{machine_line().removeprefix('machine: ')}; Python {platform.python_version()}, torch {torch.__version__}"


def run_one(script: Path, quick: bool) -> tuple[str, str, float, int]:
    argv = [sys.executable, str(script.relative_to(ROOT))] + (["--quick"] if quick else [])
    command = " ".join([".venv/bin/python", *argv[1:]])
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    output = proc.stdout + (f"\n(stderr)\n{proc.stderr[-3000:]}" if proc.returncode else "")
    # A benchmark's own "## " headings become "### ": "## " starts one benchmark's section in the document.
    output = "\n".join("#" + line if line.startswith("## ") else line for line in output.splitlines())
    return command, output, time.perf_counter() - start, proc.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="pass --quick to every benchmark")
    parser.add_argument("--only", nargs="*", default=None, help="benchmark script names (without .py) to run")
    parser.add_argument("--out", type=Path, default=None,
                        help="the Markdown record to write (default: runs/benchmarks/run_all-DATE-TIME.md)")
    args = parser.parse_args()
    out = args.out or RECORDS / f"run_all-{datetime.datetime.now():%Y-%m-%d-%H%M}.md"

    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem in set(args.only)]
    else:
        scripts = [s for s in scripts if s.stem not in ON_REQUEST]
    sections = {}
    failed = 0
    for script in scripts:
        print(f"running {script.name} ...", flush=True)
        command, output, seconds, code = run_one(script, args.quick)
        failed += code != 0
        status = "" if code == 0 else f" — FAILED (exit {code})"
        today = datetime.date.today().isoformat()
        sections[script.stem] = (f"## {script.stem}{status}\n\nRecorded {today}:\n\n```\n{command}\n```\n\n"
                                 f"{output.strip()}\n\n_(took {seconds:.0f} s)_\n")
        print(output)
    header = (f"# Benchmarks run by `benchmarks/run_all.py`\n\nOn {machine_description()}. Every benchmark runs "
              "scratchlm and its rival in the same run, interleaved, and reports medians and the ratio; the current "
              "figures of each live in docs/benchmarks.md.\n\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(header + "\n".join(sections[name] for name in sorted(sections)))
    print(f"wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
