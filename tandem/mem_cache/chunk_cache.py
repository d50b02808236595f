"""`ChunkCache` (alias `NoPrefixCache`): the `RadixCache` interface with no prefix reuse,
used for `--disable-radix-cache`.

It never holds a slot: `match_prefix` always matches nothing, `insert` stores nothing and
returns 0, `evict` frees nothing and every size is 0.

Who frees what (differs from `RadixCache`, see `takes_ownership`):
- RadixCache: after `n = insert(key, slots)` the tree owns slots[n:] and frees them when it
  evicts them; the caller frees its duplicate part of slots[:n] and never frees the rest.
- ChunkCache: `insert` takes nothing (`takes_ownership = False`) and frees nothing; the caller
  keeps owning *all* its slots and must free them itself, e.g. when the request finishes.
  Freeing them inside `insert` would be wrong: `insert` is also called per prefill chunk
  while the request still uses its slots.

The cache's pool invariant therefore reduces to `free slots + slots held by requests ==
total slots`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.mem_cache.memory_pool import TokenToKVPool
from tandem.mem_cache.radix_cache import MatchResult, TreeNode


class ChunkCache:
    """A prefix cache that caches nothing (same interface as `RadixCache`)."""

    # insert() never takes the slots it is given; the caller frees all of them.
    takes_ownership = False

    def __init__(self, token_to_kv_pool: TokenToKVPool):
        self.token_to_kv_pool = token_to_kv_pool
        self.device = token_to_kv_pool.device
        self.root_node = TreeNode(0, (), self._empty(), None, 0)

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Always an empty match ending at the (only) root node."""
        return MatchResult(slots=self._empty(), last_node=self.root_node)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Stores nothing, frees nothing, returns 0. The caller still owns all of `slots`."""
        assert slots.numel() == len(key), (slots.shape, len(key))
        return 0

    def inc_lock_ref(self, node: TreeNode) -> None:
        """No-op (only the root exists)."""

    def dec_lock_ref(self, node: TreeNode) -> None:
        """No-op (only the root exists)."""

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict: returns 0."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def reset(self) -> None:
        """Nothing to drop."""

    def all_values(self) -> torch.Tensor:
        return self._empty()

    def check_invariants(self) -> None:
        assert not self.root_node.children


NoPrefixCache = ChunkCache
