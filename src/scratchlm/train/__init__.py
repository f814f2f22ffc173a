"""train stage of scratchlm."""
