"""accounting stage of scratchlm: parameters, FLOPs, training memory and time from closed formulas, plus op studies.

The formulas need only a `ModelConfig` (no torch); `op_study` times real modules and imports torch.
"""

from scratchlm.accounting.memory import estimate_memory, max_batch_size, parse_memory, time_to_train
from scratchlm.accounting.params_flops import count_params, forward_flops, training_step_flops

__all__ = ["count_params", "estimate_memory", "forward_flops", "max_batch_size", "parse_memory", "time_to_train",
           "training_step_flops"]
