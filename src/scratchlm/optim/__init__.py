"""optim stage of scratchlm."""
