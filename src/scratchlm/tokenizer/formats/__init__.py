"""Tokenizer files, every format together: which files a folder holds and the order they are read in
(``folder.py``); scratchlm's own ``scratchlm-tokenizer.json``, GPT-2's ``vocab.json`` + ``merges.txt`` and what the
formats share (``io.py``); Hugging Face's ``tokenizer.json`` + ``tokenizer_config.json`` (``hf.py``)."""
