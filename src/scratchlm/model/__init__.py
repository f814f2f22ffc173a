"""model stage of scratchlm."""
