"""ScratchLMConfig: the config.json of a scratchlm model exported as Hugging Face custom code.

Written by `scratchlm`'s custom-code export beside modeling_scratchlm.py and the weights; transformers loads it
with ``AutoConfig.from_pretrained(folder, trust_remote_code=True)``. Every field of scratchlm's ModelConfig is
here under its own name, except ``rope_scaling`` (a reserved name in transformers, a dict there), which is
``rope_scaling_type``. The usual transformers names (hidden_size, num_hidden_layers, ...) are aliases of ours
(`attribute_map`), so generation utilities that read them find the right values.

This file imports only transformers: the folder works without scratchlm installed.
"""

from transformers import PretrainedConfig


class ScratchLMConfig(PretrainedConfig):
    model_type = "scratchlm"
    keys_to_ignore_at_inference = ["past_key_values"]
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "num_layers",
        "num_attention_heads": "num_heads",
        "num_key_value_heads": "num_kv_heads",
        "intermediate_size": "d_ff",
        "max_position_embeddings": "context_length",
    }

    # Defaults are scratchlm's ModelConfig defaults (d_ff: its SwiGLU size for d_model 512); an export writes
    # every field, so they only matter to transformers' own `ScratchLMConfig()` calls.
    def __init__(self, vocab_size=50257, context_length=256, d_model=512, num_layers=4, num_heads=16,
                 num_kv_heads=None, head_dim=None, d_ff=1408, rope_theta=10000.0, rope_scaling_type="none",
                 rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                 rope_original_context=8192, norm="rmsnorm", norm_position="pre", position="rope", ffn="swiglu",
                 tie_embeddings=False, norm_eps=1e-5, qk_norm=False, qkv_bias=False, logit_softcap=0.0,
                 use_cache=True, **kwargs):
        self.vocab_size = vocab_size
        self.context_length = context_length
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        self.head_dim = d_model // num_heads if head_dim is None else head_dim
        self.d_ff = d_ff
        self.rope_theta = rope_theta
        self.rope_scaling_type = rope_scaling_type
        self.rope_scaling_factor = rope_scaling_factor
        self.rope_low_freq_factor = rope_low_freq_factor
        self.rope_high_freq_factor = rope_high_freq_factor
        self.rope_original_context = rope_original_context
        self.norm = norm
        self.norm_position = norm_position
        self.position = position
        self.ffn = ffn
        self.tie_embeddings = tie_embeddings
        self.norm_eps = norm_eps
        self.qk_norm = qk_norm
        self.qkv_bias = qkv_bias
        self.logit_softcap = logit_softcap
        self.use_cache = use_cache
        # The model ties its head itself (it has no lm_head then): transformers' own tying stays off.
        kwargs["tie_word_embeddings"] = False
        super().__init__(**kwargs)
