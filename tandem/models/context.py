"""`ModelContext`: what a model's layers need at forward time besides their weights and
the `ForwardBatch` (where the KV cache lives, how to attend). The model runner builds one
and passes it to every forward; a leaf module, so models and the runner both import it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tandem.layers.attention.base import AttentionBackend
    from tandem.mem_cache.memory_pool import TokenToKVPool


class ModelContext:
    """What layers need besides their weights: where the KV lives and how to attend."""

    def __init__(self, kv_pool: TokenToKVPool, attn_backend: AttentionBackend):
        self.kv_pool = kv_pool
        self.attn_backend = attn_backend
