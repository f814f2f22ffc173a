"""accounting stage of scratchlm."""
