"""Fine-tuning on conversations: ``scratchlm finetune`` (supervised fine-tuning, SFT).

The pipeline, one file each: conversations.py (JSONL records -> checked examples) -> rendering.py (an example ->
token ids and the mask of the tokens the loss counts) -> packing.py (examples -> rows of a batch; a seeded,
resumable sampler) -> data.py (what the trainer draws batches from; ChatML for a base model) -> commands.py.
builders.py makes conversation files from HH-RLHF and TinyStories for the demonstration.
"""
