"""Which waiting requests join the next prefill batch, and in what order.

`SchedulePolicy` orders the waiting queue with SGLang's policies: `fcfs` (arrival order),
`lpm` (longest cached prefix first; falls back to fcfs for very long queues, where
matching every request each step would cost more than it saves), `dfs-weight` (a
depth-first walk of the prefix tree, heavier subtrees first: requests sharing a cached
prefix run together), `lof` (longest output first: largest max_new_tokens) or `random`.
Without the radix cache the two cache-aware ones (`lpm`, `dfs-weight`) are fcfs, as in
SGLang. Under --enable-priority-scheduling (`PriorityOrder`, fcfs or lof, as SGLang) the
order is by priority, then arrival (fcfs) or the longest output (lof).

`PrefillAdder` (SGLang's name) forms one prefill batch: it continues the chunked request,
then admits waiting requests one by one while their KV fits:
    budget = free slots + evictable cached slots
             - KV the running requests are expected to still need
An admitted request costs its prompt tokens not already cached plus its expected future
tokens. Under --enable-lora a request joins only while the running requests and the
batch use at most --max-loras-per-batch adapters (the slots); the others wait their turn.
Expected future tokens = remaining max_new_tokens x `new_token_ratio`, a decaying
estimate (as SGLang's): it starts at `init`, shrinks by `decay` every decode step down to
`min`, and jumps back up after a retraction. Over-admission is repaired by retraction.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field

from tandem.mem_cache.chunk_cache import ChunkCache
from tandem.mem_cache.req_kv import ReqKVManager
from tandem.scheduler.schedule_batch import Req
from tandem.server_args import SCHEDULE_POLICIES

CACHE_AWARE_POLICIES = ("lpm", "dfs-weight")
LPM_MAX_QUEUE = 128
# Defer a waiting request whose prompt shares at least this many uncached tokens with a
# request already in the prefill batch: next step it will hit the cache instead.
IN_BATCH_PREFIX_MIN = 16


@dataclass(frozen=True)
class PriorityOrder:
    """SGLang's priority scheduling. `preference(req)` is smaller for the request served
    first: its priority (low values first) or minus it (the default: high values first);
    a request without one has the lowest. A waiting request preempts a running one whose
    preference is worse by more than `threshold` (--priority-scheduling-preemption-threshold)."""

    low_values_first: bool
    threshold: int

    @property
    def lowest(self) -> int:
        """The priority of a request that gave none (SGLang's default)."""
        return sys.maxsize if self.low_values_first else -sys.maxsize - 1

    def preference(self, req: Req) -> int:
        p = self.lowest if req.priority is None else req.priority
        return p if self.low_values_first else -p

    def key(self, req: Req) -> tuple[int, float]:
        """The waiting queue's order: preference, then arrival."""
        return self.preference(req), req.queue_entry_time

    def preempts(self, waiting: Req, running: Req) -> bool:
        return self.preference(running) - self.preference(waiting) > self.threshold


class SchedulePolicy:
    def __init__(
        self, policy: str, kv: ReqKVManager, priority: PriorityOrder | None = None, rng: random.Random | None = None
    ):
        if policy not in SCHEDULE_POLICIES:
            raise ValueError(f"--schedule-policy: unknown policy {policy!r}")
        if policy in CACHE_AWARE_POLICIES and isinstance(kv.tree_cache, ChunkCache):
            policy = "fcfs"  # no prefix tree to be aware of (SGLang does the same)
        self.policy = policy
        self.kv = kv
        self.priority = priority
        self.rng = rng or random.Random()

    def order(self, waiting: list[Req]) -> list[Req]:
        """`waiting` (in arrival order) in the order requests are admitted; ties keep arrival order."""
        if self.policy == "lof":
            if self.priority is not None:
                return sorted(waiting, key=lambda r: (self.priority.preference(r), -r.sampling_params.max_new_tokens))
            return sorted(waiting, key=lambda r: -r.sampling_params.max_new_tokens)
        if self.priority is not None:
            return sorted(waiting, key=self.priority.key)
        if self.policy == "random":
            return self.rng.sample(waiting, len(waiting))
        if self.policy == "dfs-weight":
            return self._dfs_weight_order(waiting)
        if self.policy == "fcfs" or len(waiting) > LPM_MAX_QUEUE:
            return waiting
        lens = {id(r): self._match(r).slots.numel() for r in waiting}
        return sorted(waiting, key=lambda r: -lens[id(r)])

    def _match(self, req: Req):
        return self.kv.tree_cache.match_prefix(req.cache_key(req.seq_len - 1))

    def _dfs_weight_order(self, waiting: list[Req]) -> list[Req]:
        """SGLang's dfs-weight: each request sits at the deepest tree node its prompt
        matches; a node weighs the requests in its subtree. A depth-first walk from the
        root, heavier children first, lists each node's requests after its subtree's."""
        at: dict[int, list[Req]] = {}
        weight: dict[int, int] = {}
        for req in waiting:
            node = self._match(req).last_node
            at.setdefault(node.id, []).append(req)
            while node is not None:
                weight[node.id] = weight.get(node.id, 0) + 1
                node = node.parent
        ordered: list[Req] = []
        stack = [(self.kv.tree_cache.root_node, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                ordered.extend(at.get(node.id, ()))
                continue
            stack.append((node, True))
            children = sorted((c for c in node.children.values() if c.id in weight), key=lambda c: -weight[c.id])
            stack.extend((c, False) for c in reversed(children))
        return ordered


@dataclass
class NewTokenRatio:
    """Fraction of a request's remaining max_new_tokens that admission reserves."""

    init: float = 0.7
    min: float = 0.1
    decay: float = 0.001
    value: float = field(init=False)

    def __post_init__(self) -> None:
        self.value = self.init

    def step(self) -> None:
        self.value = max(self.min, self.value - self.decay)

    def on_retract(self) -> None:
        self.value = min(1.0, max(self.value, self.init) + 0.1)


def expected_future_tokens(req: Req, ratio: float) -> int:
    remaining = req.sampling_params.max_new_tokens - req.launched_output_len
    return int(max(remaining, 0) * ratio)


@dataclass
class PrefillAdder:
    """Forms one prefill batch. Budget = free + evictable slots, minus what the running
    requests and the chunked request are expected to still need; each admitted request
    must fit in what is left (with nothing running and nothing taken yet, it is taken
    anyway). Stops at the first request that does not fit, at `max_running_requests`,
    at a full ReqToTokenPool, or when the prefill token budget is spent."""

    kv: ReqKVManager
    ratio: float
    running: list[Req]
    max_running_requests: int
    # Tokens this batch may still compute: --max-prefill-tokens, and with chunked prefill
    # on also --chunked-prefill-size, which bounds the whole batch as in SGLang (the
    # request that crosses it is chunked to what is left).
    token_budget: int
    chunk_size: int | None  # --chunked-prefill-size (None: off)
    # --max-loras-per-batch: most distinct adapters the running requests and this batch use (None: no LoRA).
    max_loras: int | None = None
    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    # The request that this batch prefills only in part (it continues next step).
    chunked_req: Req | None = None
    reserved: int = field(init=False)
    adapters: set[int] = field(init=False)  # the load ids of the adapters those requests use

    def __post_init__(self) -> None:
        self.reserved = sum(expected_future_tokens(r, self.ratio) for r in self.running)
        self.adapters = {r.lora_uid for r in self.running if r.lora_uid is not None}
        if self.chunk_size is not None:
            self.token_budget = min(self.token_budget, self.chunk_size)

    def add_chunked_req(self, req: Req) -> None:
        """Continue a chunked prompt; while it still chunks, nothing else joins."""
        self.reserved += self._future_need(req)
        self._take(req)

    def add_waiting(self, ordered: list[Req]) -> None:
        """Admit from `ordered` (the policy's order) while everything fits."""
        for req in ordered:
            if self.chunked_req is not None or self.token_budget <= 0:
                break
            if len(self.running) + len(self.reqs) >= self.max_running_requests:
                break
            if self.kv.req_to_token_pool.available_size() == 0:
                break
            if not isinstance(self.kv.tree_cache, ChunkCache) and self._shares_uncached_prefix(req):
                continue  # next step it reuses the prefix this batch computes
            if not self._adapter_fits(req):
                continue  # it waits until a request of another adapter finishes
            prefix_len = self.kv.match_and_lock(req, self._max_prefix_len(req))
            need = self._future_need(req)
            if need > self.kv.available_size() - self.reserved and (self.reqs or self.running):
                self.kv.unlock(req)
                break
            if not req.admitted_once:
                req.cached_tokens = prefix_len
                req.admitted_once = True
            self.reserved += need
            self._take(req)

    def _adapter_fits(self, req: Req) -> bool:
        """Whether `req`'s adapter keeps the running set within --max-loras-per-batch."""
        uid = req.lora_uid
        return uid is None or uid in self.adapters or len(self.adapters) < self.max_loras

    def _take(self, req: Req) -> None:
        if req.lora_uid is not None:
            self.adapters.add(req.lora_uid)
        n = self._extend_len(req)
        self.reqs.append(req)
        self.extend_lens.append(n)
        self.token_budget -= n
        if n < req.seq_len - req.kv_len:  # chunked: the rest follows in later steps
            self.chunked_req = req

    def _future_need(self, req: Req) -> int:
        """KV `req` is expected to still take: its uncomputed sequence plus expected outputs."""
        return req.seq_len - req.kv_len + expected_future_tokens(req, self.ratio)

    def _extend_len(self, req: Req) -> int:
        """Tokens `req` computes in this prefill: all that remain, unless chunked."""
        remaining = req.seq_len - req.kv_len
        if self.chunk_size is None or req.wants_input_logprobs():
            return remaining  # NOTE: prompt logprobs need the whole prompt in one forward
        return max(1, min(remaining, self.chunk_size, self.token_budget))

    @staticmethod
    def _max_prefix_len(req: Req) -> int:
        """Longest cached prefix worth reusing: never the whole sequence (the last token
        must be computed for its logits), nor past where prompt logprobs start."""
        limit = req.seq_len - 1
        if req.wants_input_logprobs():
            limit = min(limit, max(req.logprob_start_len - 1, 0))
        return limit

    def _shares_uncached_prefix(self, req: Req) -> bool:
        ids = req.seq_ids
        for other in self.reqs:
            if other.lora_uid != req.lora_uid:  # no prefix is shared across adapters
                continue
            other_ids = other.seq_ids
            n = min(len(ids) - 1, len(other_ids), IN_BATCH_PREFIX_MIN * 64)
            k = 0
            while k < n and ids[k] == other_ids[k]:
                k += 1
            if k >= IN_BATCH_PREFIX_MIN and k > other.kv_len:
                return True
        return False
