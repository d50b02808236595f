"""The offline Engine: sync, async and streaming; same outputs as the HTTP server; no
process outlives shutdown() or an interpreter that exits without calling it; a GGUF file
serves as its directory does, and a bad one stops the Engine with one line before any
subprocess starts."""

from __future__ import annotations

import asyncio
import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import httpx
import pytest
from server_launcher import ServerHandle

from tandem.utils.process import pid_alive

PARAMS = {"max_new_tokens": 12, "temperature": 0}
PROMPTS = ["The cat sat", "Engines and servers agree", "x"]


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if pid_alive(pid)]


def _wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    from tandem import Engine

    eng = Engine(model_path=str(tiny_llama_dir))
    pids = eng.pids()
    assert len(pids) == 2
    ipc_dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"tandem-ipc-{os.getpid()}-*"))
    assert ipc_dirs
    yield eng
    eng.shutdown()
    assert _wait_gone(pids) == []
    # Nothing left behind: no ipc directory, no engine thread.
    assert not [d for d in ipc_dirs if os.path.exists(d)]
    assert not [t.name for t in threading.enumerate() if t.name in ("tandem-engine-loop", "child-watchdog")]


def test_sync_generate_and_batch(engine):
    single = engine.generate(PROMPTS[0], PARAMS)
    assert single["meta_info"]["finish_reason"] is not None and single["output_ids"]
    batch = engine.generate(PROMPTS, PARAMS)
    assert [b["output_ids"] for b in batch][0] == single["output_ids"]
    by_ids = engine.generate(input_ids=[[1, 50, 60, 70]], sampling_params=PARAMS)
    assert isinstance(by_ids, list) and len(by_ids[0]["output_ids"]) >= 1
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("bad", {"temperature": -1})


def test_streaming_equals_non_streaming(engine):
    # Long enough that a chunk arrives before the end even on a starved machine.
    params = {**PARAMS, "max_new_tokens": 300, "ignore_eos": True}
    full = engine.generate(PROMPTS[1], params)
    chunks = list(engine.generate(PROMPTS[1], params, stream=True))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]


def test_async_generate_and_stream(engine):
    async def run():
        outs = await asyncio.gather(*[engine.async_generate(p, PARAMS) for p in PROMPTS])
        stream = await engine.async_generate(PROMPTS[2], PARAMS, stream=True)
        chunks = [c async for c in stream]
        return outs, chunks

    outs, chunks = asyncio.run(run())
    sync = engine.generate(PROMPTS, PARAMS)
    assert [o["output_ids"] for o in outs] == [s["output_ids"] for s in sync]
    assert chunks[-1]["output_ids"] == sync[2]["output_ids"]


def test_logprobs_and_memory_after_early_stream_close(engine):
    out = engine.generate(PROMPTS[0], PARAMS, return_logprob=True, top_logprobs_num=2)
    assert len(out["meta_info"]["output_token_logprobs"]) == len(out["output_ids"])
    # The closed stream's request must stop, not run its 2000 tokens: the radix cache keeps
    # its prompt and all but its last output token (mem_cache/req_kv.py, `release`), so the
    # cached slots it adds say how far it ran. Waiting for idle has a deadline, not a
    # guessed time: a request that was not aborted ends and fails the bound.
    long, prompt = 2000, [3, 77, 78, 79, 81]  # ids no other test sends: no cached prefix
    before = _wait_engine_idle(engine)
    assert before["max_total_num_tokens"] - before["evictable_cached_slots"] > long + len(prompt)  # no eviction
    stream = engine.generate(
        input_ids=prompt, sampling_params={"max_new_tokens": long, "ignore_eos": True}, stream=True
    )
    next(stream)
    stream.close()  # aborts the request
    info = _wait_engine_idle(engine)
    assert info["free_kv_slots"] + info["evictable_cached_slots"] == info["max_total_num_tokens"]
    ran = info["evictable_cached_slots"] - before["evictable_cached_slots"]
    assert len(prompt) <= ran < len(prompt) + long // 2, ran


def _wait_engine_idle(engine, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = engine.get_server_info()
        if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0:
            return info
        assert time.monotonic() < deadline, info
        time.sleep(0.05)


def test_engine_outputs_equal_server_outputs(engine, tiny_llama_dir):
    expected = [o["output_ids"] for o in engine.generate(PROMPTS, PARAMS)]
    with ServerHandle(tiny_llama_dir, extra_args=["--skip-server-warmup"]) as server:
        got = [
            httpx.post(server.base_url + "/generate", json={"text": p, "sampling_params": PARAMS}, timeout=60).json()[
                "output_ids"
            ]
            for p in PROMPTS
        ]
    assert got == expected


def test_no_process_survives_interpreter_exit_without_shutdown(tiny_llama_dir, tmp_path):
    script = tmp_path / "use_engine.py"
    script.write_text(
        textwrap.dedent(f"""
        import json
        from tandem import Engine

        if __name__ == "__main__":
            engine = Engine(model_path={str(tiny_llama_dir)!r})
            out = engine.generate("hi", {{"max_new_tokens": 3, "temperature": 0}})
            print(json.dumps({{"pids": engine.pids(), "n": len(out["output_ids"])}}), flush=True)
            # exits without engine.shutdown()
    """)
    )
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["n"] == 3 and len(report["pids"]) == 2
    assert _wait_gone(report["pids"]) == []


def test_engine_weight_calls(engine, tiny_llama_dir, tmp_path):
    """update_weights_from_disk / get_weights_by_name (to the same weights, so the other
    tests of this module are unaffected; tests/server/test_update_weights.py covers more)."""
    from safetensors import safe_open

    ok, message = engine.update_weights_from_disk(str(tmp_path / "missing"))
    assert not ok and "config.json" in message
    assert engine.update_weights_from_disk(str(tiny_llama_dir), weight_version="v2")[0]
    assert engine.get_server_info()["weight_version"] == "v2"
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        expected = f.get_slice("model.norm.weight")[:5].float().tolist()
    assert engine.get_weights_by_name("model.norm.weight", truncate_size=5) == pytest.approx(expected)
    with pytest.raises(ValueError, match="no.such"):
        engine.get_weights_by_name("no.such")


def test_update_weights_from_tensor(engine, tiny_llama_dir, tiny_llama_b_dir):
    """Model B's tensors sent to the engine serving A: greedy outputs become B's (what an
    engine started on B gives: transformers' on B), get_weights_by_name shows B; a
    misshapen or unknown tensor changes nothing; a partial update keeps the rest. Ends
    back on A for the module's other tests."""
    import hf_reference
    import torch
    from safetensors.torch import load_file

    prompt, n = [1, 17, 42, 99, 7, 23], 12
    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
    a = load_file(str(tiny_llama_dir / "model.safetensors"))
    b = load_file(str(tiny_llama_b_dir / "model.safetensors"))
    a_ids = hf_reference.greedy_ids(tiny_llama_dir, prompt, n, min_new_tokens=n)
    b_ids = hf_reference.greedy_ids(tiny_llama_b_dir, prompt, n, min_new_tokens=n)
    assert a_ids != b_ids
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == a_ids

    ok, message = engine.update_weights_from_tensor(list(b.items()), weight_version="b")
    assert ok, message
    out = engine.generate(input_ids=prompt, sampling_params=params)
    assert out["output_ids"] == b_ids and out["meta_info"]["weight_version"] == "b"
    assert out["meta_info"]["cached_tokens"] == 0  # A's prefix KV was flushed
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.allclose(torch.tensor(engine.get_weights_by_name(name, 2)), b[name][:2])

    for bad, words in (([(name, b[name][:-1])], "shape"), ([("model.no_such.weight", torch.zeros(3))], "no_such")):
        ok, message = engine.update_weights_from_tensor(bad)
        assert not ok and words in message and "kept" in message, message
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == b_ids

    # A partial update: A's tensors but one; then the last one.
    last = "lm_head.weight" if "lm_head.weight" in a else "model.norm.weight"
    assert engine.update_weights_from_tensor([(k, v) for k, v in a.items() if k != last])[0]
    assert torch.allclose(torch.tensor(engine.get_weights_by_name(last, 2)), b[last][:2])
    assert engine.update_weights_from_tensor([(last, a[last])])[0]
    assert engine.generate(input_ids=prompt, sampling_params=params)["output_ids"] == a_ids


def test_gguf_engine_and_bad_gguf_paths(engine, tiny_llama_dir, tmp_path):
    """The tiny llama as an F32 GGUF file (its weights exactly; config and tokenizer from
    the metadata) answers as the directory's engine does."""
    import psutil
    from gguf_writer import write_gguf

    from tandem import Engine

    path = write_gguf(tiny_llama_dir, tmp_path / "tiny.gguf", "F32")
    want = engine.generate(PROMPTS, PARAMS)
    with Engine(model_path=str(path)) as gguf_engine:
        got = gguf_engine.generate(PROMPTS, PARAMS)
        assert gguf_engine.get_server_info()["load_format"] == "gguf"
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [g["text"] for g in got] == [w["text"] for w in want]

    children = {p.pid for p in psutil.Process().children(recursive=True)}
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(512))
    (tmp_path / "cut.gguf").write_bytes(path.read_bytes()[:4096])
    for bad, words in (("bad.gguf", "not a GGUF file"), ("cut.gguf", "truncated"), ("missing.gguf", "no such GGUF")):
        with pytest.raises(ValueError) as info:
            Engine(model_path=str(tmp_path / bad))
        message = str(info.value)
        assert message.startswith("--model-path: ") and words in message and bad in message, message
        assert "\n" not in message, message
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children  # none was started


def test_a_dead_subprocess_fails_waiting_and_later_calls(tiny_llama_dir):
    """The scheduler killed under a running Engine: a call already waiting and every later
    one raise EngineDeadError naming the process (they used to wait forever)."""
    from tandem import Engine
    from tandem.entrypoints.engine import EngineDeadError

    eng = Engine(model_path=str(tiny_llama_dir))
    pids = eng.pids()
    try:
        scheduler = next(p for p in eng._procs.procs if p.name.startswith("scheduler"))
        results: dict[str, BaseException | object] = {}

        def call(name, fn):
            try:
                results[name] = fn()
            except BaseException as e:  # noqa: BLE001 - the test inspects it
                results[name] = e

        os.kill(scheduler.pid, 9)
        waiting = [
            threading.Thread(target=call, args=("generate", lambda: eng.generate("The cat", PARAMS))),
            threading.Thread(target=call, args=("stream", lambda: list(eng.generate("x", PARAMS, stream=True)))),
        ]
        for t in waiting:
            t.start()
        for t in waiting:
            t.join(timeout=30)
        assert not any(t.is_alive() for t in waiting), "a call still waits on the dead engine"
        for name in ("generate", "stream"):
            assert isinstance(results[name], EngineDeadError) and scheduler.name in str(results[name]), results[name]
        with pytest.raises(EngineDeadError, match=scheduler.name):
            eng.generate("later", PARAMS)
    finally:
        eng.shutdown()
    assert _wait_gone(pids) == []
