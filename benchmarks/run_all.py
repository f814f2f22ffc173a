"""Run every side-by-side benchmark and record the figures in docs/benchmarks.md.

    .venv/bin/python benchmarks/run_all.py            # full runs (tens of minutes on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick    # short runs, noisier figures
    .venv/bin/python benchmarks/run_all.py --only bench_encode bench_model
    .venv/bin/python benchmarks/run_all.py --only bench_quality   # on request only: ~20 min (3 x 5 min training)

Each benchmark is a script `benchmarks/bench_*.py` that prints Markdown tables; this runner executes them one at a
time (so they do not compete for the cores), and rewrites docs/benchmarks.md with each script's output under the
exact command that produced it, the date, and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / "benchmarks"
DOC = ROOT / "docs" / "benchmarks.md"
# Too long for the routine list (bench_quality trains three models for 5 minutes each): run only when named in --only.
ON_REQUEST = {"bench_quality"}


def machine_description() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()} cores ({cpu}), Python {platform.python_version()}, torch {torch.__version__}"


def previous_sections() -> dict[str, str]:
    """Sections of the existing docs/benchmarks.md by benchmark name, so a partial rerun keeps the others."""
    if not DOC.exists():
        return {}
    sections = {}
    for chunk in DOC.read_text().split("\n## ")[1:]:
        name = chunk.split()[0]
        sections[name] = "## " + chunk.rstrip() + "\n"
    return sections


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
    args = parser.parse_args()

    scripts = sorted(BENCH_DIR.glob("bench_*.py"))
    if args.only:
        scripts = [s for s in scripts if s.stem in set(args.only)]
    else:
        scripts = [s for s in scripts if s.stem not in ON_REQUEST]
    sections = previous_sections()
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
    header = (f"# Benchmarks\n\nFigures recorded by `benchmarks/run_all.py` on {machine_description()}.\n"
              "Every benchmark runs scratchlm and its rival in the same run, interleaved, and reports medians and "
              "the ratio. Whole commands are timed running alone; their peak RSS (the whole process tree) comes "
              "from one more run each, sampled every 10 ms. Rerun one section with the command shown under it.\n\n")
    DOC.write_text(header + "\n".join(sections[name] for name in sorted(sections)))
    print(f"wrote {DOC}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
