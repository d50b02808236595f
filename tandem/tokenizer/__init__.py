"""The tokenizer side: runs in the main process, on the HTTP server's asyncio loop (or in each
tokenizer worker under --tokenizer-worker-num N > 1). It tokenizes and validates requests,
sends them to the scheduler and turns the detokenizer's text back into responses."""
