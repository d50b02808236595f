"""Radix tree over token ids whose values are KV slots (page size 1), as SGLang's RadixCache.

Each non-root node holds an edge: a non-empty tuple of token ids `key` and an int64 tensor
`value` of the same length, one KV slot per token. A node's full token prefix is the
concatenation of the edges from the root down to it. Children are keyed by the first token
of their edge, so siblings never share a first token.

Ownership: every slot stored in the tree is owned by the tree (it is neither free in the
`TokenToKVPool` nor owned by anyone else). The tree gives slots back to the pool only in
`evict` and `reset`. `insert` documents exactly which slots of its argument the tree takes.

Locks: `inc_lock_ref(node)` increments `lock_ref` of the node and of every ancestor (root
excluded), `dec_lock_ref` undoes it. A node is *protected* while `lock_ref > 0` and is never
evicted; since locks propagate upward, a locked node's whole path survives eviction.
`lock_ref` of a node always equals the number of outstanding locks on it or on any of its
descendants (a split copies the count to the new upper node, which keeps this true).

Sizes (in tokens, root excluded), kept incrementally so reads are O(1):
`evictable_size() + protected_size() == total_size()`, where evictable counts tokens of
nodes with `lock_ref == 0` and protected counts tokens of nodes with `lock_ref > 0`.

LRU: `last_access` is a value of a per-cache monotonic counter (deterministic, not wall
time). `match_prefix` and `insert` give every node on the path they walk a fresh stamp,
root first; a split's upper half inherits the stamp and is then touched by the walk that
split it. `evict` removes unlocked leaves, least recently used first (ties, which cannot
occur among simultaneous candidates, are broken by node id).

Everything is iterative; no recursion, so deep trees are fine.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.mem_cache.memory_pool import TokenToKVPool


class TreeNode:
    """One edge of the radix tree. Root has an empty key/value and no parent."""

    __slots__ = ("id", "key", "value", "parent", "children", "lock_ref", "last_access")

    def __init__(
        self, node_id: int, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None, last_access: int
    ):
        self.id = node_id
        self.key = key  # tuple of token ids of this edge
        self.value = value  # int64 KV slots, same length as key
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = last_access

    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, key={list(self.key)}, lock_ref={self.lock_ref}, "
            f"last_access={self.last_access}, children={len(self.children)})"
        )


@dataclass
class MatchResult:
    """Result of `match_prefix`.

    slots: int64 KV slots of the matched prefix, one per matched token (may be empty). A new
        tensor: the caller may keep or write it anywhere. The slots stay owned by the tree.
    last_node: deepest node of the match (the root when nothing matched). Its prefix is
        exactly the matched tokens. Lock it (`inc_lock_ref`) for as long as the slots are used,
        otherwise they can be evicted and reused.
    """

    slots: torch.Tensor
    last_node: TreeNode


def _common_prefix_len(a: Sequence[int], a_start: int, b: Sequence[int]) -> int:
    """Length of the common prefix of a[a_start:] and b."""
    n = min(len(a) - a_start, len(b))
    i = 0
    while i < n and a[a_start + i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache: token-id prefixes -> KV slots, with LRU eviction of unlocked leaves."""

    # The tree keeps the slots that `insert` reports as new (see `insert`).
    takes_ownership = True

    def __init__(self, token_to_kv_pool: TokenToKVPool):
        self.token_to_kv_pool = token_to_kv_pool
        self.device = token_to_kv_pool.device
        self._init_tree()

    # ------------------------------------------------------------------ internals

    def _init_tree(self) -> None:
        self._clock = 0
        self._next_id = 0
        self.root_node = self._new_node((), self._empty(), None)
        self._evictable_size = 0
        self._protected_size = 0
        self._total_size = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _new_node(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent, self._tick())
        self._next_id += 1
        return node

    def _split(self, node: TreeNode, pos: int) -> TreeNode:
        """Split `node`'s edge after `pos` tokens (0 < pos < len(node)); returns the new upper node.

        The upper node takes node's place under its parent, inherits lock_ref and last_access;
        `node` keeps the lower part and becomes the upper node's only child. Sizes are unchanged.
        """
        assert 0 < pos < len(node.key)
        parent = node.parent
        upper = TreeNode(self._next_id, node.key[:pos], node.value[:pos], parent, node.last_access)
        self._next_id += 1
        upper.lock_ref = node.lock_ref
        node.key = node.key[pos:]
        node.value = node.value[pos:]
        node.parent = upper
        upper.children[node.key[0]] = node
        parent.children[upper.key[0]] = upper
        return upper

    def _walk(self, key: Sequence[int]) -> tuple[list[TreeNode], TreeNode, int]:
        """Follow `key` down from the root: (matched nodes, deepest node, tokens matched).

        A match that ends inside an edge splits that node, so the deepest node ends exactly
        at the match. Every node on the path gets a fresh `last_access`, root side first.
        """
        node, pos, path = self.root_node, 0, []
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            k = _common_prefix_len(key, pos, child.key)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = self._tick()
            path.append(child)
            node = child
            pos += k
        return path, node, pos

    # ------------------------------------------------------------------ API

    def match_prefix(self, key: Sequence[int]) -> MatchResult:
        """Longest cached prefix of `key`.

        If the match ends inside an edge, that node is split so that `last_node` ends exactly
        at the match. Every node on the matched path gets a fresh `last_access` (root first).
        """
        path, node, _ = self._walk(key)
        slots = torch.cat([n.value for n in path]) if path else self._empty()
        return MatchResult(slots=slots, last_node=node)

    def insert(self, key: Sequence[int], slots: torch.Tensor) -> int:
        """Insert key -> slots (`len(key) == slots.numel()`); returns the length `n` of the
        prefix of `key` that was already in the tree.

        Ownership after the call:
        - slots[n:] now belong to the tree (it stores a copy of the indices; the caller must
          not free them, and may go on reading them while it holds a lock on their node).
        - slots[:n] are not taken: the tree keeps its own slots for those positions. Those of
          slots[:n] that the caller allocated itself are duplicates the caller must free.
          When slots[:k] came from an earlier `match_prefix` (they are the tree's own slots),
          the caller frees only slots[k:n] (as SGLang: free(kv[len(prefix):new_prefix_len])).
        Every node on the path of `key` gets a fresh `last_access`.
        """
        key = tuple(key)
        assert slots.dim() == 1 and slots.numel() == len(key), (slots.shape, len(key))
        _, node, pos = self._walk(key)
        n = len(key)
        if pos < n:
            value = slots[pos:].to(torch.int64).clone()
            leaf = self._new_node(key[pos:], value, node)
            node.children[key[pos]] = leaf
            added = n - pos
            self._total_size += added
            self._evictable_size += added
        return pos

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock `node` and all its ancestors (the root is a no-op). Locked nodes are never evicted."""
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        while node is not self.root_node:
            assert node.lock_ref > 0, f"dec_lock_ref on unlocked {node!r}"
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
            node.lock_ref -= 1
            node = node.parent

    def _collect_nodes(self) -> list[TreeNode]:
        """All non-root nodes (iterative DFS)."""
        out: list[TreeNode] = []
        stack = list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves, least recently used first, until at least `num_tokens`
        tokens are freed or nothing is evictable. A parent left as an unlocked leaf becomes a
        candidate too. Whole nodes are evicted, so more than `num_tokens` may be freed.
        Evicted slots go back to the pool. Returns the number of tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._collect_nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        to_free: list[torch.Tensor] = []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            to_free.append(node.value)
            size = len(node.key)
            freed += size
            self._total_size -= size
            self._evictable_size -= size
            parent = node.parent
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if to_free:
            self.token_to_kv_pool.free(torch.cat(to_free))
        return freed

    def evictable_size(self) -> int:
        """Tokens in nodes with lock_ref == 0."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in nodes with lock_ref > 0."""
        return self._protected_size

    def total_size(self) -> int:
        """All tokens (= slots) held by the tree."""
        return self._total_size

    def reset(self) -> None:
        """Drop the whole tree, freeing all its slots to the pool. Only valid with no locks."""
        assert self._protected_size == 0, "reset() while nodes are locked"
        values = self.all_values()
        if values.numel():
            self.token_to_kv_pool.free(values)
        self._init_tree()

    def all_values(self) -> torch.Tensor:
        """Every slot held by the tree (order unspecified), for invariant checks."""
        vals = [n.value for n in self._collect_nodes()]
        return torch.cat(vals) if vals else self._empty()

    def check_invariants(self) -> None:
        """Recompute everything the tree maintains incrementally and assert it matches.

        O(tree size); meant for tests and debug checks, not the hot path.
        """
        total = evictable = protected = 0
        stack = [self.root_node]
        lock_sum: dict[int, int] = {}
        nodes = []
        while stack:
            node = stack.pop()
            nodes.append(node)
            for first, child in node.children.items():
                assert child.parent is node
                assert len(child.key) > 0 and child.key[0] == first
                assert child.value.dtype == torch.int64 and child.value.numel() == len(child.key)
                assert child.lock_ref >= 0
                stack.append(child)
            if node is not self.root_node:
                total += len(node.key)
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                # A parent's lock count covers all its children's.
                if node.parent is not self.root_node:
                    lock_sum[node.parent.id] = lock_sum.get(node.parent.id, 0) + node.lock_ref
        for node in nodes:
            if node is not self.root_node:
                assert node.lock_ref >= lock_sum.get(node.id, 0), node
        assert (total, evictable, protected) == (self._total_size, self._evictable_size, self._protected_size), (
            (total, evictable, protected),
            (self._total_size, self._evictable_size, self._protected_size),
        )
