"""tokenizer stage of scratchlm."""
