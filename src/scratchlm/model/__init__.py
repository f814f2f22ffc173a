"""model stage of scratchlm: the from-scratch Transformer LM, its config and KV cache."""

from scratchlm.model.config import PRESETS, ModelConfig
from scratchlm.model.kv_cache import KVCache
from scratchlm.model.transformer import SiLUFFN, SwiGLU, TransformerBlock, TransformerLM

__all__ = ["PRESETS", "KVCache", "ModelConfig", "SiLUFFN", "SwiGLU", "TransformerBlock", "TransformerLM"]
