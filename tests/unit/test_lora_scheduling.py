"""LoRA requests through the scheduler (in-process, fp32): requests of three adapters and
of the base, more adapters than --max-loras-per-batch slots, give each request's output
alone (a batch with more adapters than slots would fail its forward); the prefix cache
shares a prefix only between requests of one adapter; an unload is refused while a
request uses the adapter, and a request for an unloaded adapter fails with a 400."""

from __future__ import annotations

import pytest
from lora_adapters import save_random_adapter
from runner_steps import greedy_steps, make_runner
from scheduler_harness import SchedulerHarness

from tandem.messages import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput

PROMPT = list(range(1, 30))
STEPS = 5


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-sched")
    targets = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj", "k_proj"]]
    return {
        name: str(save_random_adapter(tiny_llama_dir, root / name, rank=4, alpha=8, targets=t, seed=i))
        for i, (name, t) in enumerate(zip("abc", targets))
    }


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, adapters):
    """Each adapter's (and the base's, None) greedy output for PROMPT, run alone on the runner."""
    runner = make_runner(tiny_llama_dir, dtype="float32", lora_paths=[f"{n}={p}" for n, p in adapters.items()])
    out = {n: greedy_steps(runner, [PROMPT], STEPS, lora_uids=[runner.lora.uids[n]])[0][0] for n in adapters}
    out[None] = greedy_steps(runner, [PROMPT], STEPS)[0][0]
    assert len({tuple(v) for v in out.values()}) == 4  # every adapter changes the output
    return out


def _harness(model_dir, adapters, overlap: bool):
    return SchedulerHarness(
        model_dir,
        dtype="float32",
        device="cpu",
        random_seed=0,
        disable_overlap_schedule=not overlap,
        lora_paths=[f"{n}={p}" for n, p in adapters.items()],
        max_loras_per_batch=2,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_adapters_equal_each_alone(tiny_llama_dir, adapters, alone, overlap):
    h = _harness(tiny_llama_dir, adapters, overlap)
    try:
        names = ["a", "b", "c", None, "c", "a", None, "b"]
        for i, name in enumerate(names):
            h.submit(str(i), input_ids=PROMPT, max_new_tokens=STEPS, lora_name=name)
        finishes = h.run_until_idle()
        assert len(finishes) == len(names) and all(f["type"] == "length" for f in finishes.values()), finishes
        for i, name in enumerate(names):
            assert h.collected.ids[str(i)] == alone[name], f"request {i} ({name})"
        h.assert_memory_idle()
    finally:
        h.close()


def test_prefix_cache_is_per_adapter(tiny_llama_dir, adapters, alone):
    h = _harness(tiny_llama_dir, adapters, overlap=False)
    try:
        for rid, name in (("a1", "a"), ("b1", "b"), ("a2", "a"), ("base", None)):
            h.submit(rid, input_ids=PROMPT, max_new_tokens=STEPS, lora_name=name)
            h.run_until_idle()
            assert h.collected.ids[rid] == alone[name], rid
        cached = h.collected.cached_tokens
        assert cached["a1"] == cached["b1"] == cached["base"] == 0
        assert cached["a2"] == len(PROMPT) - 1
    finally:
        h.close()


def test_unload_waits_for_users(tiny_llama_dir, adapters, alone):
    h = _harness(tiny_llama_dir, adapters, overlap=False)
    s = h.scheduler
    try:
        h.submit("r", input_ids=PROMPT, max_new_tokens=STEPS, lora_name="b")
        s.process_input_requests(s.recv_requests())
        reply = s.control.lora.unload(UnloadLoRAAdapterReqInput("u1", "b"))
        assert not reply.success and reply.in_use == ["r"] and "in use by 1" in reply.error_message
        h.run_until_idle()
        assert h.collected.ids["r"] == alone["b"]
        reply = s.control.lora.unload(UnloadLoRAAdapterReqInput("u2", "b"))
        assert reply.success and set(reply.loaded_adapters) == {"a", "c"}
        h.submit("late", input_ids=PROMPT, lora_name="b")
        assert h.run_until_idle()["late"]["status_code"] == 400
        reply = s.control.lora.load(LoadLoRAAdapterReqInput("l", "b2", adapters["b"]))
        assert reply.success and set(reply.loaded_adapters) == {"a", "c", "b2"}
        h.submit("again", input_ids=PROMPT, max_new_tokens=STEPS, lora_name="b2")
        h.run_until_idle()
        assert h.collected.ids["again"] == alone["b"]
        assert h.collected.cached_tokens["again"] == 0  # b's cached prefix is not b2's
    finally:
        h.close()
