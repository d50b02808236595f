"""The scheduler side: one subprocess per tensor-parallel rank (and per data-parallel
replica). It batches requests, owns their KV, runs the model worker and sends token ids on."""
