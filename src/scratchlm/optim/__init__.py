"""optim stage of scratchlm: AdamW, the learning-rate schedule and gradient clipping, from tensor primitives."""

from scratchlm.optim.adamw import AdamW, param_groups_for
from scratchlm.optim.clip import clip_gradients
from scratchlm.optim.schedule import lr_cosine_schedule

__all__ = ["AdamW", "clip_gradients", "lr_cosine_schedule", "param_groups_for"]
