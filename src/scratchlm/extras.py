"""Optional dependencies: a feature that needs a package outside the plain install names the pip extra to add.

A plain ``pip install scratchlm`` trains, evaluates and generates (torch, numpy, regex, tqdm, safetensors). The
extras in pyproject.toml add one feature each: ``[plot]`` learning curves (matplotlib), ``[hf]`` export/import of
Hugging Face checkpoints (transformers, tokenizers), ``[hub]`` the Hugging Face Hub (huggingface_hub: `data download`,
`export hf --push-to-hub`), ``[tracking]`` TensorBoard and W&B, ``[serve]`` `scratchlm serve` (fastapi, uvicorn),
``[gguf]`` `export gguf` / `import gguf` (the gguf package, llama.cpp's GGUF reader and writer).
A feature asked for without its extra fails with one line naming the extra, never a traceback; the curves, which
nobody asked for explicitly, are skipped with one warning instead (trainer.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType

from scratchlm.errors import UserError


class MissingExtra(UserError):
    """A feature's optional package is not installed (the message says which extra provides it)."""


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise MissingExtra naming the pip extra that provides it."""
    imported = optional_import(module)
    if imported is None:
        raise MissingExtra(f"{feature} needs the {module.split('.')[0]} package, which is not installed: "
                           f"pip install 'scratchlm[{extra}]'")
    return imported


def optional_import(module: str) -> ModuleType | None:
    """``module``, or None when its package is not installed.

    Only the package itself being absent counts: an installed package that fails on one of ITS imports is a
    broken install, and its own error is more useful than ours.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as error:
        if error.name is not None and error.name.split(".")[0] != module.split(".")[0]:
            raise
        return None
