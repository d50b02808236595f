"""LoRA adapters (tandem/lora) on the model runner against `peft` on the same tiny random
Llama and the same random adapters, in float32: greedy tokens equal PeftModel.generate's,
every step's logits within 1e-4 of the largest; a batch mixing three adapters and the
base equals each request run alone (and the base rows equal a server without LoRA); the
slot pool evicts by LRU; load errors name the adapter and the module; tensor parallelism 2
gives TP 1's tokens and logits."""

from __future__ import annotations

import pytest
from lora_adapters import peft_reference, save_random_adapter
from runner_steps import assert_greedy_matches_transformers, assert_near_largest, greedy_steps, make_runner

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """name -> path: every module at rank 8; q and v at rank 4 with rsLoRA; o, gate and down at rank 16."""
    root = tmp_path_factory.mktemp("lora")
    specs = {
        "a": dict(rank=8, alpha=16, targets=ALL, seed=1),
        "b": dict(rank=4, alpha=8, targets=["q_proj", "v_proj"], seed=2, rslora=True),
        "c": dict(rank=16, alpha=8, targets=["o_proj", "gate_proj", "down_proj"], seed=3),
    }
    return {name: str(save_random_adapter(tiny_llama_dir, root / name, **s)) for name, s in specs.items()}


def _runner(model_dir, adapters, **kw):
    return make_runner(model_dir, dtype="float32", lora_paths=[f"{n}={p}" for n, p in adapters.items()], **kw)


@pytest.mark.slow
def test_each_adapter_matches_peft(tiny_llama_dir, adapters):
    runner = _runner(tiny_llama_dir, adapters, enable_lora=True)
    for name, path in adapters.items():
        uid = runner.lora.uids[name]
        got = greedy_steps(runner, PROMPTS, STEPS, lora_uids=[uid] * len(PROMPTS))
        assert_greedy_matches_transformers(got, peft_reference(tiny_llama_dir, path), PROMPTS, STEPS)


def test_mixed_batch_equals_each_alone(tiny_llama_dir, adapters):
    runner = _runner(tiny_llama_dir, adapters, enable_lora=True)
    uids = [runner.lora.uids[n] for n in adapters] + [None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(uids))]
    mixed_ids, mixed_logits = greedy_steps(runner, prompts, STEPS, lora_uids=uids)
    plain = make_runner(tiny_llama_dir, dtype="float32")
    for i, (uid, prompt) in enumerate(zip(uids, prompts)):
        ids, logits = greedy_steps(runner if uid is not None else plain, [prompt], STEPS, lora_uids=[uid])
        assert mixed_ids[i] == ids[0], f"request {i}"
        for step, step_logits in enumerate(logits):
            assert_near_largest(mixed_logits[step][i], step_logits[0], 1e-5)
    assert len(set(map(tuple, mixed_ids))) == len(uids)  # every adapter changed the output


def test_slots_evict_least_recently_used(tiny_llama_dir, adapters):
    runner = _runner(tiny_llama_dir, adapters, enable_lora=True, max_loras_per_batch=2)
    want = {n: greedy_steps(runner, PROMPTS[:1], 2, lora_uids=[runner.lora.uids[n]])[0] for n in "abc"}
    assert set(runner.lora.slot_of) == {runner.lora.uids["b"], runner.lora.uids["c"]}  # a was evicted
    for name in "acba":  # each in and out of the two slots again
        assert greedy_steps(runner, PROMPTS[:1], 2, lora_uids=[runner.lora.uids[name]])[0] == want[name]
    with pytest.raises(RuntimeError, match="--max-loras-per-batch is 2"):
        greedy_steps(runner, PROMPTS, 1, lora_uids=[runner.lora.uids[n] for n in "abc"])


def test_load_errors_name_the_module(tiny_llama_dir, tiny_mqa_dir, adapters, tmp_path):
    with pytest.raises(ValueError, match=r"'c': rank 16 exceeds --max-lora-rank 8"):
        _runner(tiny_llama_dir, adapters, max_lora_rank=8)
    runner = make_runner(
        tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, lora_target_modules=["q_proj", "v_proj"]
    )
    with pytest.raises(ValueError, match=r"'a': module 'model.layers.0.[a-z_.]+' is not a LoRA target"):
        runner.lora.load("a", adapters["a"])
    other = save_random_adapter(tiny_mqa_dir, tmp_path / "mqa", rank=4, alpha=4, targets=["k_proj"], seed=4)
    runner = make_runner(
        tiny_llama_dir, dtype="float32", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"]
    )
    with pytest.raises(ValueError, match=r"'m': module 'model.layers.\d.self_attn.k_proj' shapes .* do not match"):
        runner.lora.load("m", str(other))
    with pytest.raises(ValueError, match="no adapter_config.json"):
        runner.lora.load("x", str(tmp_path))
    assert runner.lora.loaded() == {}


def _lora_steps_on_rank(tp, model_dir: str, adapters: dict[str, str]):
    """The mixed batch's greedy ids and logits on this rank (fp32, adapters a, b, c and the base)."""
    from tandem.model_executor.model_runner import ModelRunner
    from tandem.server_args import ServerArgs

    args = ServerArgs(
        model_path=model_dir,
        device="cpu",
        dtype="float32",
        max_total_tokens=1024,
        max_running_requests=8,
        random_seed=0,
        chunked_prefill_size=-1,
        lora_paths=[f"{n}={p}" for n, p in adapters.items()],
    )
    runner = ModelRunner(args, tp.rank, tp.size)
    uids = [runner.lora.uids[n] for n in adapters] + [None]
    return greedy_steps(runner, [PROMPTS[i % len(PROMPTS)] for i in range(len(uids))], STEPS, lora_uids=uids)


@pytest.mark.slow  # two gloo ranks in subprocesses
def test_two_ranks_equal_one(tiny_llama_dir, adapters, tmp_path):
    """A split as the base layers: B's rows on column-parallel layers, A's columns on
    row-parallel ones (their delta all-reduced with the output)."""
    from test_parallel_layers import run_on_ranks

    from tandem.distributed import TpGroup

    single_ids, single_logits = _lora_steps_on_rank(TpGroup(), str(tiny_llama_dir), adapters)
    for ids, logits in run_on_ranks(_lora_steps_on_rank, 2, tmp_path / "ranks", str(tiny_llama_dir), adapters):
        assert ids == single_ids
        for got, want in zip(logits, single_logits):
            assert_near_largest(got, want, 1e-4)
