"""serve stage of scratchlm: an OpenAI-compatible completions server over the decoding engine.

The engine is generate/engine.py, the one generate() runs on: here it runs on a thread of its own, and
requests join its batch between decoding steps and leave it when they end, each with its own sampling settings.
What this package adds is the protocol and HTTP around it:
- protocol.py: the OpenAI completions protocol: request validation, response and error objects.
- app.py: the FastAPI application (routes, API key, server-sent events, the playground page in static/).
- commands.py: `scratchlm serve`, its limits, and uvicorn with a graceful SIGTERM.

Only commands.py is imported by `scratchlm --help`; fastapi and uvicorn (the [serve] extra) load when serving.
"""
