"""compat stage of scratchlm."""
