"""scratchlm: build and train Llama-style Transformer language models from scratch.

The package is laid out as the pipeline it implements:
tokenizer -> data -> model -> optim -> train -> generate, plus accounting, cli and compat.
"""

__version__ = "0.1.0"
