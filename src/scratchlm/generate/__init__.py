"""generate stage of scratchlm: sampling from a TransformerLM with a KV cache (see sampling.py)."""

from scratchlm.generate.sampling import generate, sample_next, stream, top_k_filter, top_p_filter

__all__ = ["generate", "sample_next", "stream", "top_k_filter", "top_p_filter"]
