"""serve stage of scratchlm: an OpenAI-compatible completions server over a continuously batched decoder.

- engine.py: the batched decoder. One thread owns the model; requests join the running batch between decoding
  steps and leave it when they end, each with its own sampling settings (generate/sampling.py's rule).
  It knows nothing of HTTP and can be driven directly.
- batch_cache.py: the batch's `KVCache`, in buffers for max_batch rows: rows join (add), leave (keep) and
  padding columns go (compact).
- text.py: token ids -> text as it is sampled (incremental UTF-8) and stop strings.
- limits.py: the server's limits and their defaults.
- protocol.py: the OpenAI completions protocol: request validation, response and error objects.
- app.py: the FastAPI application (routes, API key, server-sent events, the playground page in static/).
- server.py: uvicorn with a graceful SIGTERM; commands.py: `scratchlm serve`.

Only commands.py is imported by `scratchlm --help`; fastapi and uvicorn (the [serve] extra) load when serving.
"""
