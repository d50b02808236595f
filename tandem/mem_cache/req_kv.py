"""Request-level KV bookkeeping: rows, slots and the prefix cache, in one place.

The scheduler (and bench_one_batch) call these instead of touching the pools directly.
Per request (`Req`):
  req_pool_idx      its ReqToTokenPool row while it holds KV (None otherwise)
  kv_len            leading tokens of seq_ids whose KV slots are in the row
  cache_owned_len   leading row slots that belong to the prefix cache (the request
                    holds a lock on `last_node` for them); slots after it are the
                    request's own and are freed or handed to the cache when it ends.
Ownership rules of the caches are in radix_cache.py and chunk_cache.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.mem_cache.chunk_cache import ChunkCache
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from tandem.mem_cache.radix_cache import RadixCache

if TYPE_CHECKING:
    from tandem.scheduler.schedule_batch import Req


class ReqKVManager:
    def __init__(
        self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, tree_cache: RadixCache | ChunkCache
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.tree_cache = tree_cache

    # ---- capacity ------------------------------------------------------------------
    def available_size(self) -> int:
        """Slots that can be had now: free ones plus unlocked cached ones (evictable)."""
        return self.token_to_kv_pool.available_size() + self.tree_cache.evictable_size()

    def _alloc_slots(self, n: int) -> torch.Tensor | None:
        free = self.token_to_kv_pool.available_size()
        if n > free:
            self.tree_cache.evict(n - free)
        return self.token_to_kv_pool.alloc(n)

    # ---- admission -----------------------------------------------------------------
    def match_and_lock(self, req: Req, max_prefix_len: int) -> int:
        """Give `req` a row holding the longest cached prefix (at most `max_prefix_len`
        tokens) of its sequence, locked while the request uses it. Returns its length."""
        assert req.req_pool_idx is None
        match = self.tree_cache.match_prefix(req.cache_key(max_prefix_len))
        self.tree_cache.inc_lock_ref(match.last_node)
        req.last_node = match.last_node
        row = self.req_to_token_pool.alloc()
        assert row is not None, "admission checks for a free row"
        req.req_pool_idx = row
        if match.slots.numel():
            self.req_to_token_pool.write(row, 0, match.slots)
        req.kv_len = req.cache_owned_len = int(match.slots.numel())
        return req.kv_len

    def unlock(self, req: Req) -> None:
        """Undo match_and_lock for a request that was not admitted after all."""
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len, req.cache_owned_len = None, None, 0, 0

    # ---- allocation for a forward --------------------------------------------------
    def alloc_extend(self, reqs: list[Req], extend_lens: list[int]) -> torch.Tensor:
        """Slots for each request's next `extend_lens[i]` tokens, written into its row."""
        slots = self.try_alloc_extend(reqs, extend_lens)
        assert slots is not None, "admission guaranteed these slots"
        return slots

    def try_alloc_extend(self, reqs: list[Req], extend_lens: list[int]) -> torch.Tensor | None:
        """`alloc_extend`, or None when memory is short (a speculative verify step)."""
        slots = self._alloc_slots(sum(extend_lens))
        if slots is None:
            return None
        offset = 0
        for req, n in zip(reqs, extend_lens):
            self.req_to_token_pool.write(req.req_pool_idx, req.kv_len, slots[offset : offset + n])
            offset += n
        return slots

    def alloc_decode(self, reqs: list[Req]) -> torch.Tensor | None:
        """One slot per request for its newest token; None when memory is exhausted."""
        slots = self._alloc_slots(len(reqs))
        if slots is None:
            return None
        self.req_to_token_pool.write_one_each([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], slots)
        return slots

    def release_rejected(self, req: Req) -> None:
        """After a speculative verify step: the slots computed past the request's accepted
        tokens (its rejected drafts) go back to the pool at once; kv_len == seq_len - 1
        again. They are the request's own (past cache_owned_len)."""
        keep = req.seq_len - 1
        if req.req_pool_idx is None or req.kv_len <= keep:
            return
        self.token_to_kv_pool.free(self.req_to_token_pool.req_to_token[req.req_pool_idx, keep : req.kv_len].clone())
        req.kv_len = keep

    # ---- caching and release -------------------------------------------------------
    def _insert(self, req: Req, kv_len: int) -> None:
        """Hand the request's first `kv_len` computed tokens to the cache (a radix tree
        keeps what it lacks)."""
        if not isinstance(self.tree_cache, RadixCache):
            return
        row_slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, :kv_len]
        present = self.tree_cache.insert(req.cache_key(kv_len), row_slots)
        if present > req.cache_owned_len:  # computed again what the tree already had
            self.token_to_kv_pool.free(row_slots[req.cache_owned_len : present].clone())

    def cache_unfinished(self, req: Req) -> None:
        """After a prefill (or chunk): put the prompt's KV in the cache so others can reuse
        it, and switch the request's row and lock to the cache's copy."""
        if not isinstance(self.tree_cache, RadixCache) or req.kv_len == 0:
            return
        self._insert(req, req.kv_len)
        match = self.tree_cache.match_prefix(req.cache_key(req.kv_len))
        assert match.slots.numel() == req.kv_len
        self.req_to_token_pool.write(req.req_pool_idx, 0, match.slots)
        self.tree_cache.inc_lock_ref(match.last_node)
        self.tree_cache.dec_lock_ref(req.last_node)
        req.last_node = match.last_node
        req.cache_owned_len = req.kv_len

    def release(self, req: Req) -> None:
        """The request stops holding KV (finished, aborted or retracted): its KV goes to
        the cache (radix) or back to the pool (no cache); its row is freed.

        Under the overlap loop a finished request may have one more decode in flight,
        computing the KV of its last output token: that slot is freed, not cached, so
        the cache holds what it would without overlap (never the last token's KV)."""
        row = req.req_pool_idx
        if row is None:
            return
        kept = min(req.kv_len, req.seq_len - 1) if req.output_ids else req.kv_len
        if isinstance(self.tree_cache, RadixCache):
            self._insert(req, kept)
            extra = self.req_to_token_pool.req_to_token[row, kept : req.kv_len]
        else:
            extra = self.req_to_token_pool.req_to_token[row, : req.kv_len]
        if extra.numel():
            self.token_to_kv_pool.free(extra.clone())
        if req.last_node is not None:
            self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        req.req_pool_idx, req.last_node, req.kv_len, req.cache_owned_len = None, None, 0, 0
