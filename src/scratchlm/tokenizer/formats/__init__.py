"""Tokenizer files, every format together: which files a folder holds and the order they are read in
(``folder.py``); scratchlm's own ``scratchlm-tokenizer.json`` and GPT-2's ``vocab.json`` + ``merges.txt``
(``io.py``); Hugging Face's ``tokenizer.json`` + ``tokenizer_config.json`` (``hf.py``); and the flags Hugging Face
gives added tokens beyond their text and id (``formats/added_tokens.py``)."""
