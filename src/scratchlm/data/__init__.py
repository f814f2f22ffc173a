"""data stage of scratchlm."""
