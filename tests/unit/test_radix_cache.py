"""RadixCache and ChunkCache: fixed cases plus a Hypothesis state machine against an exact
reference model.

Reference model of the stateful test:
- `ref`: dict mapping every cached token prefix (a tuple, length >= 1) to the KV slot of its
  last token. The tree's content is exactly this dict (checked after every step by walking
  the tree), so match lengths, match slots and insert return values are predicted exactly.
- `touch`: prefix -> id of the last cache operation that walked through it. A node's LRU
  stamp must order like (touch[first prefix of the node], depth of that prefix).
- Eviction is predicted by a brute-force LRU simulation over a snapshot of the tree's nodes.
- Memory: every slot 1..size is exactly once either free in the pool, in the tree, or held
  privately by the test.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tandem.mem_cache.chunk_cache import ChunkCache, NoPrefixCache
from tandem.mem_cache.memory_pool import TokenToKVPool
from tandem.mem_cache.radix_cache import MatchResult, RadixCache, TreeNode

POOL_SIZE = 40


def make_pool(size: int = POOL_SIZE) -> TokenToKVPool:
    return TokenToKVPool(size, num_layers=1, num_kv_heads=1, head_dim=1, dtype=torch.float32, device="cpu")


def alloc(pool: TokenToKVPool, n: int) -> torch.Tensor:
    out = pool.alloc(n)
    assert out is not None
    return out


# ---------------------------------------------------------------------- tree helpers


def iter_nodes(cache: RadixCache):
    """(node, prefix-before-node) for every non-root node, iteratively."""
    stack = [(c, ()) for c in cache.root_node.children.values()]
    while stack:
        node, before = stack.pop()
        yield node, before
        full = before + tuple(node.key)
        stack.extend((c, full) for c in node.children.values())


def tree_contents(cache: RadixCache) -> dict[tuple, int]:
    out = {}
    for node, before in iter_nodes(cache):
        for i, slot in enumerate(node.value.tolist()):
            out[before + tuple(node.key[: i + 1])] = slot
    return out


def node_prefix(cache: RadixCache, node: TreeNode) -> tuple:
    """Full token prefix of node; asserts it is still attached to the root."""
    parts = []
    while node is not cache.root_node:
        assert node.parent is not None, "node detached from the tree"
        assert node.parent.children.get(node.key[0]) is node
        parts.append(tuple(node.key))
        node = node.parent
    return tuple(t for p in reversed(parts) for t in p)


def check_memory(cache: RadixCache, pool: TokenToKVPool, private: list[torch.Tensor]) -> None:
    n_private = sum(int(t.numel()) for t in private)
    assert pool.available_size() + cache.total_size() + n_private == pool.size
    everything = torch.cat([pool._free_slots, cache.all_values(), *private])
    assert torch.equal(torch.sort(everything).values, torch.arange(1, pool.size + 1)), (
        "a slot is lost, duplicated, or both free and in use"
    )


def check_sizes(cache: RadixCache) -> None:
    ev = pr = 0
    for node, _ in iter_nodes(cache):
        if node.lock_ref > 0:
            pr += len(node.key)
        else:
            ev += len(node.key)
    assert cache.evictable_size() == ev
    assert cache.protected_size() == pr
    assert cache.total_size() == ev + pr == cache.all_values().numel()
    cache.check_invariants()


# ---------------------------------------------------------------------- fixed cases


def test_empty_tree():
    pool = make_pool()
    cache = RadixCache(pool)
    m = cache.match_prefix([1, 2, 3])
    assert isinstance(m, MatchResult)
    assert m.slots.dtype == torch.int64 and m.slots.numel() == 0
    assert m.last_node is cache.root_node
    assert cache.match_prefix([]).last_node is cache.root_node
    assert cache.insert([], torch.empty(0, dtype=torch.int64)) == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.evict(10) == 0
    check_memory(cache, pool, [])


def test_insert_returns_shared_prefix_len_and_caller_frees_duplicates():
    pool = make_pool()
    cache = RadixCache(pool)
    a = alloc(pool, 3)
    assert cache.insert([1, 2, 3], a) == 0
    b = alloc(pool, 4)
    n = cache.insert((1, 2, 4, 5), b)
    assert n == 2
    pool.free(b[:n])  # duplicates of tree-owned slots a[:2]
    assert cache.total_size() == 5
    check_memory(cache, pool, [])
    for key, expect in [([1, 2, 3], 3), ([1], 1), ([1, 2, 4, 5], 4), ([1, 2, 4], 3), ([7], 0)]:
        c = alloc(pool, len(key))
        assert cache.insert(key, c) == expect
        pool.free(c[:expect])
        check_memory(cache, pool, [])
    # [7] was new: the tree took it.
    assert cache.total_size() == 6
    m = cache.match_prefix([1, 2, 4, 5, 6])
    assert m.slots.tolist() == a[:2].tolist() + b[2:].tolist()
    check_sizes(cache)


def test_insert_stores_a_copy_of_slots():
    pool = make_pool()
    cache = RadixCache(pool)
    row = torch.zeros(8, dtype=torch.int64)  # like a req_to_token row
    row[:3] = alloc(pool, 3)
    expect = row[:3].tolist()
    cache.insert([4, 5, 6], row[:3])
    row[:] = 0  # the row is reused by another request
    assert cache.match_prefix([4, 5, 6]).slots.tolist() == expect


def test_match_splits_inside_an_edge():
    pool = make_pool()
    cache = RadixCache(pool)
    s = alloc(pool, 4)
    cache.insert([1, 2, 3, 4], s)
    (only,) = cache.root_node.children.values()
    assert only.key == (1, 2, 3, 4)

    m = cache.match_prefix([1, 2, 9])
    assert m.slots.tolist() == s[:2].tolist()
    upper = m.last_node
    assert tuple(upper.key) == (1, 2) and upper.parent is cache.root_node
    assert cache.root_node.children[1] is upper
    (lower,) = upper.children.values()
    assert lower is only and tuple(lower.key) == (3, 4) and lower.parent is upper
    assert lower.value.tolist() == s[2:].tolist()
    assert cache.total_size() == 4
    check_sizes(cache)

    # A match ending exactly at a node boundary does not split again.
    m2 = cache.match_prefix([1, 2])
    assert m2.last_node is upper
    assert len(list(iter_nodes(cache))) == 2
    # A match that ends at the end of the key, inside an edge, splits too.
    m3 = cache.match_prefix([1, 2, 3])
    assert tuple(m3.last_node.key) == (3,) and m3.slots.tolist() == s[:3].tolist()
    assert node_prefix(cache, m3.last_node) == (1, 2, 3)
    check_sizes(cache)
    check_memory(cache, pool, [])


def test_insert_splits_inside_an_edge():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], alloc(pool, 4))
    c = alloc(pool, 2)
    assert cache.insert([1, 2], c) == 2
    pool.free(c)
    upper = cache.root_node.children[1]
    assert tuple(upper.key) == (1, 2) and list(upper.children) == [3]
    check_sizes(cache)
    check_memory(cache, pool, [])


def test_split_keeps_locks_consistent():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3, 4], alloc(pool, 4))
    m = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    cache.match_prefix([1, 2])  # splits the locked node
    upper = cache.root_node.children[1]
    assert upper.lock_ref == 1 and m.last_node.lock_ref == 1 and m.last_node.parent is upper
    check_sizes(cache)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(m.last_node)
    assert upper.lock_ref == 0 and cache.evictable_size() == 4 and cache.protected_size() == 0
    assert cache.evict(1) == 2  # the leaf [3, 4] goes as a whole
    assert cache.evict(1) == 2
    assert cache.total_size() == 0
    check_memory(cache, pool, [])


def test_lru_eviction_order():
    pool = make_pool()
    cache = RadixCache(pool)
    a, b, c = alloc(pool, 2), alloc(pool, 2), alloc(pool, 2)
    cache.insert([1, 1], a)
    cache.insert([2, 2], b)
    cache.insert([3, 3], c)
    cache.match_prefix([1, 1, 5])  # A is now the most recently used
    assert cache.evict(1) == 2
    assert cache.match_prefix([2, 2]).slots.numel() == 0  # B (oldest) went first
    assert cache.match_prefix([3, 3]).slots.numel() == 2
    cache.match_prefix([3, 3])
    assert cache.evict(2) == 2
    assert cache.match_prefix([1, 1]).slots.numel() == 0  # now A is the oldest
    assert cache.match_prefix([3, 3]).slots.numel() == 2
    check_memory(cache, pool, [])


def test_lru_parent_becomes_evictable_leaf():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], alloc(pool, 3))
    y = alloc(pool, 3)
    pool.free(y[: cache.insert([1, 2, 4], y)])  # splits: (1,2) -> {(3), (4)}
    cache.insert([5, 5, 5], alloc(pool, 3))
    # Stamps: (3) oldest < (1,2) < (4) < (5,5,5).
    assert cache.evict(1) == 1
    assert sorted(tree_contents(cache)) == sorted([(1,), (1, 2), (1, 2, 4), (5,), (5, 5), (5, 5, 5)])
    assert cache.evict(1) == 1  # (4): (1,2) is not a leaf yet
    assert cache.evict(1) == 2  # (1,2) became an unlocked leaf older than (5,5,5)
    assert sorted(tree_contents(cache)) == [(5,), (5, 5), (5, 5, 5)]
    check_memory(cache, pool, [])


def test_locked_path_survives_eviction():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], alloc(pool, 3))
    y = alloc(pool, 4)
    pool.free(y[: cache.insert([1, 2, 4, 4], y)])
    cache.insert([5], alloc(pool, 1))
    m = cache.match_prefix([1, 2, 4, 4])
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 4 and cache.evictable_size() == 2
    assert cache.evict(100) == 2
    assert sorted(tree_contents(cache)) == [(1,), (1, 2), (1, 2, 4), (1, 2, 4, 4)]
    cache.dec_lock_ref(m.last_node)
    with pytest.raises(AssertionError):
        cache.dec_lock_ref(m.last_node)
    check_sizes(cache)


def test_evict_frees_whole_nodes_and_returns_count():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert(list(range(10)), alloc(pool, 10))
    before = pool.available_size()
    assert cache.evict(0) == 0
    assert cache.evict(3) == 10
    assert pool.available_size() == before + 10
    check_memory(cache, pool, [])


def test_reset():
    pool = make_pool()
    cache = RadixCache(pool)
    cache.insert([1, 2, 3], alloc(pool, 3))
    cache.insert([1, 4], torch.cat([cache.match_prefix([1]).slots, alloc(pool, 1)]))
    cache.insert([9, 9], alloc(pool, 2))
    private = alloc(pool, 5)
    m = cache.match_prefix([9, 9])
    cache.inc_lock_ref(m.last_node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.dec_lock_ref(m.last_node)
    cache.reset()
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert not cache.root_node.children
    assert pool.available_size() == pool.size - 5
    check_memory(cache, pool, [private])
    # Usable after reset.
    s = alloc(pool, 2)
    assert cache.insert([1, 2], s) == 0
    assert cache.match_prefix([1, 2, 3]).slots.tolist() == s.tolist()


def test_deep_tree_no_recursion():
    depth = 1500  # more nodes on one path than the default recursion limit
    pool = make_pool(depth + 10)
    cache = RadixCache(pool)
    key = [i % 7 for i in range(depth)]
    s = alloc(pool, depth)
    cache.insert(key, s)
    for n in range(depth - 1, 0, -1):  # split at every position, deepest first (O(depth) each)
        cache.match_prefix(key[:n])
    assert len(list(iter_nodes(cache))) == depth
    assert cache.match_prefix(key).slots.tolist() == s.tolist()
    check_sizes(cache)
    m = cache.match_prefix(key)
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == depth
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(depth // 2) == depth // 2  # one token per node, deepest (oldest) first
    assert cache.match_prefix(key).slots.tolist() == s[: depth - depth // 2].tolist()
    cache.reset()
    check_memory(cache, pool, [])


# ---------------------------------------------------------------------- ChunkCache


@pytest.mark.parametrize("cls", [ChunkCache, NoPrefixCache])
def test_chunk_cache_reuses_nothing(cls):
    pool = make_pool()
    cache = cls(pool)
    assert cache.takes_ownership is False and RadixCache.takes_ownership is True
    s = alloc(pool, 3)
    assert cache.insert([1, 2, 3], s) == 0
    # insert took nothing and freed nothing: the caller still owns all of s.
    assert pool.available_size() == pool.size - 3
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.dtype == torch.int64 and m.slots.numel() == 0
    assert m.last_node is cache.root_node
    cache.inc_lock_ref(m.last_node)
    cache.dec_lock_ref(m.last_node)
    assert cache.evict(10) == 0
    assert (cache.total_size(), cache.evictable_size(), cache.protected_size()) == (0, 0, 0)
    assert cache.all_values().numel() == 0
    cache.reset()
    assert pool.available_size() == pool.size - 3
    pool.free(s)  # the caller frees its slots itself (e.g. when the request finishes)
    assert pool.available_size() == pool.size
    cache.check_invariants()


# ---------------------------------------------------------------------- state machine

keys = st.lists(st.integers(0, 2), min_size=0, max_size=7)


class RadixCacheMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.pool = make_pool()
        self.cache = RadixCache(self.pool)
        self.ref: dict[tuple, int] = {}
        self.touch: dict[tuple, int] = {}
        self.op = 0
        self.locks: list[tuple[TreeNode, tuple]] = []
        self.private: list[torch.Tensor] = []

    # -- reference helpers

    def ref_match_len(self, key) -> int:
        n = 0
        while n < len(key) and tuple(key[: n + 1]) in self.ref:
            n += 1
        return n

    def record_touch(self, key, n: int) -> None:
        self.op += 1
        for i in range(1, n + 1):
            self.touch[tuple(key[:i])] = self.op

    # -- checked operations

    def do_match(self, key) -> MatchResult:
        expect = self.ref_match_len(key)
        m = self.cache.match_prefix(key)
        self.record_touch(key, expect)
        assert m.slots.dtype == torch.int64
        assert m.slots.tolist() == [self.ref[tuple(key[: i + 1])] for i in range(expect)]
        assert node_prefix(self.cache, m.last_node) == tuple(key[:expect])
        return m

    def do_insert(self, key, slots: torch.Tensor, owned_prefix: int = 0) -> int:
        """Insert; the slots[:owned_prefix] came from a match (tree-owned). Frees duplicates."""
        expect = self.ref_match_len(key)
        n = self.cache.insert(key, slots)
        self.record_touch(key, len(key))
        assert n == expect
        assert n >= owned_prefix
        self.pool.free(slots[owned_prefix:n])
        for i in range(n, len(key)):
            self.ref[tuple(key[: i + 1])] = int(slots[i])
        return n

    def do_evict(self, num_tokens: int) -> int:
        # Brute-force LRU simulation on a snapshot.
        nodes = {}
        for node, before in iter_nodes(self.cache):
            nodes[node.id] = dict(
                node=node,
                parent=None if node.parent is self.cache.root_node else node.parent.id,
                size=len(node.key),
                stamp=node.last_access,
                locked=node.lock_ref > 0,
                prefixes=[before + tuple(node.key[: i + 1]) for i in range(len(node.key))],
            )
        alive = set(nodes)
        freed = 0
        evicted: list[tuple] = []
        while num_tokens > 0 and freed < num_tokens:
            has_child = {nodes[i]["parent"] for i in alive}
            cands = [i for i in alive if i not in has_child and not nodes[i]["locked"]]
            if not cands:
                break
            victim = min(cands, key=lambda i: (nodes[i]["stamp"], i))
            alive.remove(victim)
            freed += nodes[victim]["size"]
            evicted += nodes[victim]["prefixes"]

        avail = self.pool.available_size()
        got = self.cache.evict(num_tokens)
        assert got == freed
        assert self.pool.available_size() == avail + got
        assert got >= num_tokens or self.cache.evictable_size() == 0
        for p in evicted:
            del self.ref[p]
        return got

    def alloc_or_evict(self, n: int) -> torch.Tensor | None:
        if self.pool.available_size() < n:
            self.do_evict(n - self.pool.available_size())
        return self.pool.alloc(n)

    # -- rules

    @rule(key=keys)
    def insert_fresh(self, key):
        """A request finished: all its slots are its own; the duplicates get freed."""
        slots = self.alloc_or_evict(len(key))
        if slots is not None:
            self.do_insert(key, slots)

    @rule(key=keys, lock=st.booleans())
    def match(self, key, lock):
        m = self.do_match(key)
        if lock:
            self.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, node_prefix(self.cache, m.last_node)))

    @rule(key=keys, other=keys, extra=st.integers(0, 3), relock=st.booleans())
    def scheduler_flow(self, key, other, extra, relock):
        """Match+lock a prompt, allocate the rest, let another request insert meanwhile,
        then insert the whole sequence (prompt + generated tokens), freeing only the
        caller-allocated duplicates, and swap the lock to the new last node (as SGLang's
        cache_unfinished_req) or release it."""
        m = self.do_match(key)
        self.cache.inc_lock_ref(m.last_node)
        prefix_len = m.slots.numel()
        full_key = list(key) + [(t + 1) % 3 for t in key[:extra]]
        new = self.alloc_or_evict(len(full_key) - prefix_len)
        if new is None:
            self.cache.dec_lock_ref(m.last_node)
            return
        self.private.append(new)
        self.insert_fresh(other)
        self.private.pop()
        self.do_insert(full_key, torch.cat([m.slots, new]), owned_prefix=prefix_len)
        if relock:
            m2 = self.do_match(full_key)
            assert m2.slots.numel() == len(full_key)
            self.cache.inc_lock_ref(m2.last_node)
            self.locks.append((m2.last_node, tuple(full_key)))
        self.cache.dec_lock_ref(m.last_node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 12))
    def evict(self, n):
        self.do_evict(n)

    @rule(n=st.integers(1, 8))
    def alloc_private(self, n):
        s = self.alloc_or_evict(n)
        if s is not None:
            self.private.append(s)

    @precondition(lambda self: self.private)
    @rule()
    def free_private(self):
        self.pool.free(self.private.pop(0))

    @precondition(lambda self: not self.locks)
    @rule()
    def reset(self):
        self.cache.reset()
        self.ref.clear()
        assert self.cache.total_size() == 0

    # -- invariants

    @invariant()
    def contents_match_reference(self):
        assert tree_contents(self.cache) == self.ref

    @invariant()
    def sizes_match_recomputation(self):
        check_sizes(self.cache)

    @invariant()
    def memory_accounted(self):
        check_memory(self.cache, self.pool, self.private)

    @invariant()
    def locks_consistent(self):
        expected: dict[int, int] = {}
        for node, prefix in self.locks:
            assert node_prefix(self.cache, node) == prefix  # locked nodes survive, unchanged end
            n = node
            while n is not self.cache.root_node:
                expected[n.id] = expected.get(n.id, 0) + 1
                n = n.parent
        for node, _ in iter_nodes(self.cache):
            assert node.lock_ref == expected.get(node.id, 0), node

    @invariant()
    def lru_stamps_follow_reference(self):
        order = sorted(iter_nodes(self.cache), key=lambda nb: nb[0].last_access)
        ref_keys = [(self.touch[before + (node.key[0],)], len(before)) for node, before in order]
        assert ref_keys == sorted(ref_keys) and len(set(ref_keys)) == len(ref_keys)

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.dec_lock_ref(node)
        # Idle server invariant (docs/architecture.md, "KV memory and the radix cache"):
        # free + evictable == total, no locks left.
        for t in self.private:
            self.pool.free(t)
        assert self.cache.protected_size() == 0
        assert self.pool.available_size() + self.cache.evictable_size() == self.pool.size
        self.cache.reset()
        assert self.pool.available_size() == self.pool.size


RadixCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestRadixCacheStateful = RadixCacheMachine.TestCase
