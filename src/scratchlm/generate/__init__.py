"""generate stage of scratchlm."""
