"""generate stage of scratchlm: the decoding engine (engine.py), generate() and stream() on it (decoding.py), and
the sampling rule (sampling.py).

The names below are imported on first use, so `scratchlm --help` (which imports generate.commands) never
loads torch.
"""

_LAZY = {"generate": "decoding", "stream": "decoding", "sample_next": "sampling", "top_k_filter": "sampling",
         "top_p_filter": "sampling"}
__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"scratchlm.generate.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
