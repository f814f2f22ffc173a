"""experiments stage of scratchlm."""
