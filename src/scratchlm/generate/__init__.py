"""generate stage of scratchlm: sampling from a TransformerLM with a KV cache (see sampling.py).

The names below are imported on first use, so `scratchlm --help` (which imports generate.commands) never
loads torch.
"""

__all__ = ["generate", "sample_next", "stream", "top_k_filter", "top_p_filter"]


def __getattr__(name: str):
    if name in __all__:
        from scratchlm.generate import sampling

        return getattr(sampling, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
