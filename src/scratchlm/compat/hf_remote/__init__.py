"""The modeling files of a custom-code Hugging Face folder (see compat/hf_custom_code.py).

`configuration_scratchlm.py` and `modeling_scratchlm.py` are not part of scratchlm's own code paths: the export
copies them, byte for byte, beside the weights, and transformers imports them from there with
``trust_remote_code=True``. They import only torch and transformers, never scratchlm.
"""
