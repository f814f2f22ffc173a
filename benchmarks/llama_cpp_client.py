"""Where scripts/setup_llama_cpp.sh put llama.cpp, and running benchmarks/llama_cpp_driver.py under it.

The venv is ``$SCRATCHLM_LLAMA_CPP_VENV``, else ``${XDG_CACHE_HOME:-~/.cache}/scratchlm/llama-cpp-VERSION`` (the
script's default); tests skip and the benchmark stops, naming the script, when it is absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

LLAMA_CPP_VERSION = "0.3.36"  # scripts/setup_llama_cpp.sh's pin
DRIVER = Path(__file__).resolve().with_name("llama_cpp_driver.py")


def llama_cpp_venv() -> Path:
    """The venv scripts/setup_llama_cpp.sh builds (whether or not it exists)."""
    if os.environ.get("SCRATCHLM_LLAMA_CPP_VENV"):
        return Path(os.environ["SCRATCHLM_LLAMA_CPP_VENV"])
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "scratchlm" / f"llama-cpp-{LLAMA_CPP_VERSION}"


def llama_cpp_python() -> Path | None:
    """That venv's python, or None when it has not been built."""
    python = llama_cpp_venv() / "bin" / "python"
    return python if python.is_file() else None


def run_llama_cpp(models: list[dict], *, timeout: float = 600) -> dict:
    """The driver's reply to `models` (its request format); RuntimeError with llama.cpp's stderr when it fails."""
    python = llama_cpp_python()
    if python is None:
        raise RuntimeError(f"no llama.cpp venv at {llama_cpp_venv()}: run scripts/setup_llama_cpp.sh")
    done = subprocess.run([str(python), str(DRIVER)], input=json.dumps(models), capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp driver failed ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)
