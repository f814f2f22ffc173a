"""model stage of scratchlm: the from-scratch Transformer LM, its config and KV cache.

The modules here are the readable algorithm; `scratchlm.model.kernels` holds faster implementations of the same
math that the trainer and the generator switch on from outside (`kernels.apply`, `kernels.decoding`).

`ModelConfig` needs no torch; the modules are imported on first use, so that planning tools (`scratchlm
accounting`, `scratchlm --help`) start without loading torch.
"""

from scratchlm.model.config import PRESETS, ModelConfig

_LAZY = {"KVCache": "scratchlm.model.kv_cache", "SiLUFFN": "scratchlm.model.transformer",
         "SwiGLU": "scratchlm.model.transformer", "TransformerBlock": "scratchlm.model.transformer",
         "TransformerLM": "scratchlm.model.transformer"}

__all__ = ["PRESETS", "KVCache", "ModelConfig", "SiLUFFN", "SwiGLU", "TransformerBlock", "TransformerLM"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
