"""The OpenAI-compatible HTTP API (chat, completions, models, tokenize) over the
TokenizerManager. `add_openai_routes` mounts it on the FastAPI app."""
