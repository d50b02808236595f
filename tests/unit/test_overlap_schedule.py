"""The overlap loop (the default on CUDA) against the normal loop (the default on CPU):
the same requests give the same tokens, logprobs and finishes, token for token; a
request that finished while its next step was already launched loses that extra token,
and its KV is released exactly once. In-process, on the tiny model (scheduler_harness)."""

from __future__ import annotations

import random

import pytest
import torch
from scheduler_harness import SchedulerHarness, loop_configurations

from tandem.scheduler.forward_executor import ForwardStats
from tandem.scheduler.future_map import FutureMap

PROMPT_LENS = [3, 9, 17, 30, 5, 44, 12, 7]


def prompts(n: int, seed: int = 0, vocab: int = 200) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LENS[i % len(PROMPT_LENS)])] for i in range(n)]


def workload(stop: str | None = None) -> list[tuple[str, list[int], dict]]:
    """(rid, prompt, fields) of a mixed batch: lengths, stops, n > 1, logprobs, seeds, penalties."""
    p = prompts(12)
    reqs = [(f"plain-{i}", p[i], {"max_new_tokens": 4 + 5 * i}) for i in range(6)]
    reqs += [(f"sample-{k}", p[6], {"max_new_tokens": 9}) for k in range(3)]  # n > 1: same prompt
    reqs += [
        (
            "logprobs",
            p[7],
            {
                "max_new_tokens": 7,
                "logprobs": {
                    "return_logprob": True,
                    "top_logprobs_num": 3,
                    "logprob_start_len": 2,
                    "token_ids_logprob": [5, 9],
                },
            },
        )
    ]
    reqs += [("seeded", p[8], {"max_new_tokens": 12, "temperature": 1.0, "top_k": 20, "sampling_seed": 7})]
    reqs += [
        (
            "penalties",
            p[9],
            {
                "max_new_tokens": 14,
                "temperature": 0.8,
                "sampling_seed": 3,
                "frequency_penalty": 0.5,
                "presence_penalty": 0.3,
                "repetition_penalty": 1.3,
            },
        )
    ]
    reqs += [
        (
            "min-tokens",
            p[10],
            {"max_new_tokens": 10, "min_new_tokens": 6, "ignore_eos": False, "stop_token_ids": [7, 8, 9, 10, 11, 12]},
        )
    ]
    reqs += [("eos", p[11], {"max_new_tokens": 40, "ignore_eos": False})]
    if stop is not None:
        reqs += [("stop", p[0], {"max_new_tokens": 30, "stop": [stop]})]
    return reqs


def run(
    model_dir, overlap: bool, reqs, stagger: int = 0, wait_for_grammars: bool = False, **server_args
) -> SchedulerHarness:
    """Submit `reqs` (all at once, or one every `stagger` steps) and run until idle.
    `wait_for_grammars`: each step admits only once every pending grammar has compiled
    (the queue's blocking mode, as under TP), so which requests share a batch, and so
    whether a small pool retracts, does not depend on how fast the compile threads ran."""
    h = SchedulerHarness(model_dir, disable_overlap_schedule=not overlap, **server_args)
    h.scheduler.grammar_queue.blocking = wait_for_grammars
    h.extra_steps = 0  # results of a request that had already finished (overlap only)
    process = h.scheduler.process_batch_result

    def counting_process(batch, result) -> None:
        h.extra_steps += sum(r.finished() for r in batch.reqs)
        process(batch, result)

    h.scheduler.process_batch_result = counting_process
    try:
        for rid, ids, fields in reqs:
            fields = dict(fields)
            h.submit(rid, input_ids=ids, stream=True, logprobs=fields.pop("logprobs", None), **fields)
            for _ in range(stagger):
                h.step()
        h.run_until_idle()
        h.assert_memory_idle()
        assert set(h.collected.finishes) == {r[0] for r in reqs}
        h.assert_released_once()
        return h
    finally:
        h.close()


def split(value, floats: list[float]):
    """`value` with its floats taken out (into `floats`), to compare ids exactly."""
    if isinstance(value, float):
        floats.append(value)
        return "f"
    if isinstance(value, (list, tuple)):
        return [split(v, floats) for v in value]
    if isinstance(value, dict):
        return {k: split(v, floats) for k, v in value.items()}
    return value


def assert_same(a: SchedulerHarness, b: SchedulerHarness) -> None:
    """Same tokens and finishes; same logprobs (to float noise: under a small pool the
    two loops retract at different steps, so batches are composed differently)."""
    assert a.collected.ids == b.collected.ids
    assert a.collected.finishes == b.collected.finishes
    floats_a, floats_b = [], []
    assert split(dict(a.collected.logprobs), floats_a) == split(dict(b.collected.logprobs), floats_b)
    assert floats_a == pytest.approx(floats_b, abs=1e-4)
    assert a.collected.completion_tokens == b.collected.completion_tokens


def stop_string(model_dir) -> str:
    """A piece of text the first request generates, to stop it there."""
    h = run(model_dir, False, [("probe", prompts(1)[0], {"max_new_tokens": 30})])
    text = h.scheduler.tokenizer.decode(h.collected.ids["probe"][8:10])
    assert text.strip(), text
    return text


@pytest.mark.parametrize("server_args", loop_configurations(small_pool_tokens=90))
def test_overlap_matches_normal_loop(tiny_llama_dir, server_args):
    reqs = workload(stop_string(tiny_llama_dir))
    normal = run(tiny_llama_dir, False, reqs, **server_args)
    overlap = run(tiny_llama_dir, True, reqs, **server_args)
    assert_same(normal, overlap)
    assert normal.extra_steps == 0 and overlap.extra_steps > 0
    assert normal.collected.finishes["stop"]["type"] == "stop"
    assert len(normal.collected.logprobs["logprobs"]) >= 1
    if "max_total_tokens" in server_args:
        for h in (normal, overlap):
            assert sum(h.collected.retractions.values()) > 0, "the pool was not small enough to retract"


def test_staggered_arrivals_match(tiny_llama_dir):
    reqs = workload()
    assert_same(run(tiny_llama_dir, False, reqs, stagger=2), run(tiny_llama_dir, True, reqs, stagger=2))


def test_abort_mid_stream(tiny_llama_dir):
    """An abort while the request's next step is in flight: it ends with abort, its
    tokens are a prefix of what it would have generated, its KV comes back once."""
    reqs = [(f"r{i}", ids, {"max_new_tokens": 40}) for i, ids in enumerate(prompts(4))]
    full = run(tiny_llama_dir, True, reqs)
    for overlap in (False, True):
        h = SchedulerHarness(tiny_llama_dir, disable_overlap_schedule=not overlap)
        try:
            for rid, ids, fields in reqs:
                h.submit(rid, input_ids=ids, stream=True, **fields)
            for _ in range(6):
                h.step()
            h.abort("r1")
            h.run_until_idle()
            got = h.collected
            assert got.finishes["r1"]["type"] == "abort"
            assert 0 < len(got.ids["r1"]) < 40
            assert got.ids["r1"] == full.collected.ids["r1"][: len(got.ids["r1"])]
            assert {rid: got.ids[rid] for rid in ("r0", "r2", "r3")} == {
                rid: full.collected.ids[rid] for rid in ("r0", "r2", "r3")
            }
            h.assert_released_once()
            h.assert_memory_idle()
        finally:
            h.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_abort_between_chunks_of_a_prompt(tiny_llama_dir, overlap):
    """An abort while a long prompt is prefilled chunk by chunk: it ends with abort and no
    tokens, leaves the chunk slot, and its KV comes back once."""
    h = SchedulerHarness(tiny_llama_dir, disable_overlap_schedule=not overlap, chunked_prefill_size=8)
    try:
        h.submit("long", input_ids=prompts(6)[5], stream=True, max_new_tokens=10)  # 44 tokens: 6 chunks
        h.step()
        assert h.scheduler.batches.chunked_req is not None
        h.abort("long")
        h.run_until_idle()
        assert h.collected.finishes["long"] == {"type": "abort", "message": "aborted"}
        assert h.collected.ids["long"] == []
        assert h.scheduler.batches.chunked_req is None
        h.assert_released_once()
        h.assert_memory_idle()
    finally:
        h.close()


def test_stress_short_requests_arriving_while_others_finish(tiny_llama_dir):
    """Many short requests, a few at a time, under a small pool: none lost, none
    finished twice (Collected asserts it), each released once, memory idle at the end."""
    rng = random.Random(1)
    ids = prompts(60, seed=2)
    h = SchedulerHarness(tiny_llama_dir, max_total_tokens=200, chunked_prefill_size=16)
    try:
        for i in range(60):
            h.submit(f"s{i}", input_ids=ids[i], stream=rng.random() < 0.5, max_new_tokens=rng.randint(1, 8))
            if rng.random() < 0.2:
                h.abort(f"s{rng.randrange(i + 1)}")
            for _ in range(rng.randint(0, 3)):
                h.step()
        h.run_until_idle()
        assert set(h.collected.finishes) == {f"s{i}" for i in range(60)}
        h.assert_released_once(admitted=False)
        h.assert_memory_idle()
    finally:
        h.close()


def test_future_map_resolves_placeholders_only():
    fm = FutureMap(4, "cpu")
    fm.store(torch.tensor([2, 0]), torch.tensor([70, 50]))
    ids = torch.tensor([5, FutureMap.placeholder(2), 0, FutureMap.placeholder(0)])
    assert fm.resolve(ids).tolist() == [5, 70, 0, 50]
    assert fm.resolve(torch.tensor([], dtype=torch.int64)).numel() == 0


def test_forward_stats_count_only_gaps_while_busy():
    stats = ForwardStats(window=10)
    stats.record(0.0, 1.0)
    stats.record(1.5, 2.5)  # 0.5 s idle before it
    assert stats.idle_fraction() == pytest.approx(0.5 / 2.5)
    stats.mark_idle()  # nothing to run: the next gap is not counted
    stats.record(100.0, 101.0)
    assert stats.idle_fraction() == pytest.approx(0.5 / 3.5)
