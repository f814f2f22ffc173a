"""Fine-tuning on conversations: ``scratchlm finetune`` (supervised fine-tuning, SFT).

The pipeline, one file each:
conversations.py (JSONL records -> checked examples) -> rendering.py (an example -> token ids and the mask of the
tokens the loss counts) -> packing.py (examples -> rows of a batch, several conversations a row without attending
across them, or one a row padded; a seeded, resumable sampler) -> growth.py (a base model without a chat template
gets ChatML's two tokens) -> data.py (what the trainer draws batches and validation losses from) -> commands.py.
builders.py makes conversation files from HH-RLHF and TinyStories for the demonstration.
"""
