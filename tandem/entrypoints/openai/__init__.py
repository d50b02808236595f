"""The OpenAI-compatible HTTP API (chat, completions, models, tokenize) over the
TokenizerManager. `router.add_openai_routes` mounts it on the FastAPI app (app.py)."""
