"""`ModelContext`: what a model's layers need at forward time besides their weights and
the `ForwardBatch` (where the KV cache lives, how to attend, which LoRA adapter each
token uses). The model runner builds one and passes it to every forward (a copy with the
batch's `LoraBatch` when adapters are served); a leaf module, so models and the runner
both import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.layers.attention.base import AttentionBackend
    from tandem.lora.batch import LoraBatch
    from tandem.mem_cache.memory_pool import TokenToKVPool


class ModelContext:
    """What layers need besides their weights: where the KV lives, how to attend, and
    the forward's adapters (`lora`; None: no request of the batch uses one)."""

    def __init__(self, kv_pool: TokenToKVPool, attn_backend: AttentionBackend, lora: LoraBatch | None = None):
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
        self.lora = lora

    def with_lora(self, lora: LoraBatch | None) -> ModelContext:
        """This context for a forward whose tokens use `lora`'s adapters."""
        return self if lora is None else ModelContext(self.kv_pool, self.attn_backend, lora)
