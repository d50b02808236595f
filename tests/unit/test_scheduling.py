"""Scheduling (#5), in-process (scheduler_harness): the radix cache, chunked prefill,
mixed chunks, policies and retraction never change outputs, and memory comes back.
These ran through real servers (30-170 s each) before the scheduler's I/O could be
replaced; what they test is the scheduler's logic, so they run it directly, in both
loops (overlap and normal)."""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness

from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tandem.scheduler.schedule_policy import PriorityOrder

SYSTEM = (
    "You are a helpful assistant who answers questions about the weather, the sea, "
    "and small animals in a friendly and careful way. "
)
PROMPTS = [
    SYSTEM + q
    for q in [
        "What is rain?",
        "Why is the sea salty?",
        "Do cats like boats?",
        "Tell me about clouds.",
        "What do rabbits eat?",
        "Is fog cold?",
    ]
]
PROMPTS += ["A completely different prompt with no shared prefix at all.", SYSTEM]
GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": False}
LOOPS = ["overlap", "normal"]


def open_harness(model_dir, loop: str, **server_args) -> SchedulerHarness:
    return SchedulerHarness(model_dir, disable_overlap_schedule=loop == "normal", **server_args)


def run(h: SchedulerHarness, prompts: list[list[int]], params: dict, tag: str = "", logprobs=None) -> list[str]:
    """Submit all at once, run until idle; the rids, in prompt order."""
    rids = [f"{tag}{len(h.collected.finishes) + i}" for i in range(len(prompts))]
    for rid, ids in zip(rids, prompts):
        h.submit(rid, input_ids=ids, logprobs=logprobs, **params)
    h.run_until_idle()
    h.assert_memory_idle()
    h.assert_released_once()
    return rids


@pytest.fixture(scope="module")
def tokenized(tiny_llama_dir) -> list[list[int]]:
    h = open_harness(tiny_llama_dir, "normal")
    try:
        return [h.scheduler.tokenizer.encode(p) for p in PROMPTS]
    finally:
        h.close()


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tokenized) -> list[list[int]]:
    """Outputs of the default scheduler, one request at a time."""
    h = open_harness(tiny_llama_dir, "normal")
    try:
        return [h.collected.ids[run(h, [ids], GREEDY)[0]] for ids in tokenized]
    finally:
        h.close()


@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize(
    "server_args",
    [
        {},
        {"disable_radix_cache": True},
        {"chunked_prefill_size": 16},
        {"chunked_prefill_size": 7, "schedule_policy": "lpm"},
        {"chunked_prefill_size": -1, "schedule_policy": "lpm"},
        {"disable_radix_cache": True, "chunked_prefill_size": 5},
        {"enable_mixed_chunk": True},
        {"enable_mixed_chunk": True, "chunked_prefill_size": 8},
    ],
    ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items()) or "default",
)
def test_outputs_do_not_change_with_features(tiny_llama_dir, tokenized, reference, loop, server_args):
    h = open_harness(tiny_llama_dir, loop, **server_args)
    try:
        rids = run(h, tokenized, GREEDY)
        assert [h.collected.ids[r] for r in rids] == reference
        cached = [h.collected.cached_tokens[r] for r in rids]
        if server_args.get("disable_radix_cache"):
            assert all(c == 0 for c in cached)
        else:
            assert any(c > 0 for c in cached)  # the shared system prompt is computed once
    finally:
        h.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_small_kv_pool_retracts_and_completes(tiny_llama_dir, tokenized, reference, loop):
    params = {**GREEDY, "max_new_tokens": 60, "ignore_eos": True}
    prompts = [ids + [100 + i] for i, ids in enumerate(tokenized * 2)]
    big = open_harness(tiny_llama_dir, loop)
    try:
        singles = [big.collected.ids[run(big, [p], params)[0]] for p in prompts]
    finally:
        big.close()
    h = open_harness(tiny_llama_dir, loop, max_total_tokens=400, chunked_prefill_size=32)
    try:
        rids = run(h, prompts, params)
        assert [h.collected.ids[r] for r in rids] == singles
        assert sum(h.collected.retractions.values()) > 0, "the pool was meant to run out"
        assert h.collected.ids[run(h, [tokenized[0]], GREEDY)[0]] == reference[0]  # still serving
    finally:
        h.close()


@pytest.mark.parametrize("loop", LOOPS)
def test_mixed_chunk_keeps_outputs_and_logprobs(tiny_llama_dir, tokenized, loop, monkeypatch):
    """Prefills (chunked, with prompt logprobs) run while another request decodes, so
    every prefill forward carries that request's decode step too (attention splits each
    such forward into its prefill and decode parts)."""
    mixed_attention_calls = []
    split = TorchNativeAttnBackend._forward_mixed
    monkeypatch.setattr(
        TorchNativeAttnBackend,
        "_forward_mixed",
        lambda self, *args, **kwargs: mixed_attention_calls.append(args[0]) or split(self, *args, **kwargs),
    )
    logprobs = {"return_logprob": True, "logprob_start_len": 0}
    ref = open_harness(tiny_llama_dir, loop)
    try:
        want = [run(ref, [ids], GREEDY, logprobs=logprobs)[0] for ids in tokenized[:4]]
    finally:
        ref.close()
    h = open_harness(tiny_llama_dir, loop, enable_mixed_chunk=True, chunked_prefill_size=8)
    try:
        h.submit("long", input_ids=tokenized[6], max_new_tokens=400)
        for _ in range(3):
            h.step()
        got = []
        for i, ids in enumerate(tokenized[:4]):  # one after another, each prefilled beside the long one
            h.submit(f"p{i}", input_ids=ids, logprobs=logprobs, **GREEDY)
            while f"p{i}" not in h.collected.finishes:
                h.step()
            got.append(f"p{i}")
        assert "long" not in h.collected.finishes  # it decoded beside every prefill
        assert mixed_attention_calls, "no mixed forward reached attention as a mixed batch"
        h.run_until_idle()
        assert len(h.collected.ids["long"]) == 400
        for g, w in zip(got, want):
            assert h.collected.ids[g] == ref.collected.ids[w]
            for mine, theirs in zip(h.collected.logprobs[g], ref.collected.logprobs[w]):
                for a, b in zip(mine[0] + (mine[3] or []), theirs[0] + (theirs[3] or [])):
                    assert a[1] == b[1]
                    assert (a[0] is None and b[0] is None) or abs(a[0] - b[0]) < 1e-4
        h.assert_memory_idle()
    finally:
        h.close()


def test_chunked_prefill_size_bounds_the_whole_prefill_batch(tiny_llama_dir, monkeypatch):
    """As in SGLang, --chunked-prefill-size caps the tokens of one prefill forward, not
    only of one request: requests arriving together are prefilled in batches of at most
    that many tokens, the request that crosses the cap chunked to what is left."""
    h = open_harness(tiny_llama_dir, "normal", chunked_prefill_size=8)
    try:
        sizes = []
        form = h.scheduler.batches.get_new_prefill_batch

        def recording(*args):
            batch = form(*args)
            if batch is not None:
                sizes.append(list(batch.extend_lens))
            return batch

        monkeypatch.setattr(h.scheduler.batches, "get_new_prefill_batch", recording)
        run(h, [[5 + i, 6, 7, 8, 9] for i in range(5)], {"temperature": 0, "max_new_tokens": 2})
        assert sizes and all(sum(s) <= 8 for s in sizes), sizes
        assert sizes[0] == [5, 3], sizes  # the second request chunked to fill the forward
        assert sum(map(sum, sizes)) == 25
    finally:
        h.close()


def _queued(h: SchedulerHarness, prompts: list[list[int]], max_new: list[int]) -> list:
    """Submit without running: the waiting queue, in arrival order."""
    for i, (ids, n) in enumerate(zip(prompts, max_new)):
        h.submit(f"q{i}", input_ids=ids, max_new_tokens=n)
    s = h.scheduler
    s.process_input_requests(s.recv_requests())
    return list(s.batches.waiting_queue)


def test_schedule_policies_order_the_waiting_queue(tiny_llama_dir, tokenized):
    """SGLang's orders: dfs-weight walks the prefix tree heavier subtrees first, so the
    three requests under the cached system prompt come before the one under the other
    cached prompt that arrived first, and the uncached one (at the root, after its
    subtrees) last; lof by max_new_tokens (ties by arrival); random permutes; the
    cache-aware ones are fcfs without the radix cache."""
    other = tokenized[6]
    prompts = [other + [7, 8], tokenized[0], tokenized[1], tokenized[2], [9, 10, 11, 12]]
    h = open_harness(tiny_llama_dir, "normal", schedule_policy="dfs-weight")
    try:
        run(h, [other], GREEDY)  # cached first: the tree lists its branch first
        run(h, [tokenized[7]], GREEDY)
        waiting = _queued(h, prompts, [5, 9, 2, 9, 4])
        order = [r.rid for r in h.scheduler.batches.policy.order(waiting)]
        assert order == ["q1", "q2", "q3", "q0", "q4"], order
        h.scheduler.batches.policy.policy = "lof"
        assert [r.rid for r in h.scheduler.batches.policy.order(waiting)] == ["q1", "q3", "q0", "q4", "q2"]
        h.scheduler.batches.policy.priority = PriorityOrder(low_values_first=False, threshold=10)
        for r, priority in zip(waiting, [1, 0, 0, 1, 1]):
            r.priority = priority
        # Under priority scheduling: by priority (high first here), then the longest output.
        assert [r.rid for r in h.scheduler.batches.policy.order(waiting)] == ["q3", "q0", "q4", "q1", "q2"]
        h.scheduler.batches.policy.priority = None
        h.scheduler.batches.policy.policy = "random"
        orders = {tuple(r.rid for r in h.scheduler.batches.policy.order(waiting)) for _ in range(6)}
        assert len(orders) > 1 and all(sorted(o) == [r.rid for r in waiting] for o in orders)
        h.run_until_idle()
        h.assert_memory_idle()
    finally:
        h.close()
    h = open_harness(tiny_llama_dir, "normal", schedule_policy="dfs-weight", disable_radix_cache=True)
    try:
        assert h.scheduler.batches.policy.policy == "fcfs"
    finally:
        h.close()


@pytest.mark.parametrize("policy", ["dfs-weight", "lof", "random"])
def test_outputs_do_not_change_with_the_policy(tiny_llama_dir, tokenized, reference, policy):
    h = open_harness(tiny_llama_dir, "overlap", schedule_policy=policy)
    try:
        rids = run(h, tokenized, GREEDY)
        assert [h.collected.ids[r] for r in rids] == reference
    finally:
        h.close()
