"""Weight updates without a restart (issue #12 part 2): /update_weights_from_disk swaps in
model B's weights (same architecture, another seed), /get_weights_by_name shows them, the
weight version moves, the memory invariant holds; a bad update leaves model A serving.
GGUF files update the same way (from a directory to a file, file to file), and one of
another shape is refused naming the field."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import hf_reference
import httpx
import pytest
import torch
from gguf_writer import write_gguf
from http_helpers import assert_memory_idle, generate, stream_events
from runner_steps import greedy_steps, make_runner
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from server_launcher import ServerHandle

from tandem.model_executor.gguf_loader import iterate_gguf_weights
from tandem.tools.make_tiny_model import make_tiny_model

PROMPT = [1, 17, 42, 99, 7, 23]
NEW_TOKENS = 12
EMBED = "model.embed_tokens.weight"


@pytest.fixture(scope="module")
def model_b(tiny_llama_b_dir):
    return tiny_llama_b_dir


@pytest.fixture(scope="module")
def client(tiny_llama_dir):
    """A server of its own: the updates must not reach the shared session server."""
    with ServerHandle(tiny_llama_dir) as handle, httpx.Client(base_url=handle.base_url, timeout=120) as c:
        yield c


def greedy(client) -> dict:
    return generate(
        client, input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    )


def checkpoint_rows(model_dir, name: str, rows: int) -> torch.Tensor:
    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        return f.get_slice(name)[:rows].float()


def test_bad_updates_keep_model_a(client, tiny_llama_dir, tmp_path_factory):
    before = greedy(client)
    assert before["output_ids"] == hf_reference.greedy_ids(
        tiny_llama_dir, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS
    )
    mqa = make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-mqa-bad", arch="llama", preset="tiny-mqa")
    for path, words in ((tmp_path_factory.mktemp("empty") / "nothing", "config.json"), (mqa, "num_key_value_heads")):
        r = client.post("/update_weights_from_disk", json={"model_path": str(path)})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["success"] is False and words in body["message"], body
    assert greedy(client)["output_ids"] == before["output_ids"]
    assert client.get("/server_info").json()["weight_version"] == "default"
    assert client.post("/update_weights_from_disk", json={}).status_code == 400


def test_update_to_model_b(client, tiny_llama_dir, model_b):
    a_rows = client.post("/get_weights_by_name", json={"name": EMBED, "truncate_size": 2})
    assert a_rows.status_code == 200, a_rows.text
    assert torch.allclose(torch.tensor(a_rows.json()), checkpoint_rows(tiny_llama_dir, EMBED, 2))
    assert greedy(client)["meta_info"]["weight_version"] == "default"

    r = client.post("/update_weights_from_disk", json={"model_path": str(model_b), "load_format": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 0

    out = greedy(client)
    expected = hf_reference.greedy_ids(model_b, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert expected != hf_reference.greedy_ids(tiny_llama_dir, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert out["output_ids"] == expected
    assert out["meta_info"]["weight_version"] == "1"
    assert out["meta_info"]["cached_tokens"] == 0  # the prefix cache was flushed with the old weights
    b_rows = client.post("/get_weights_by_name", json={"name": EMBED, "truncate_size": 2}).json()
    assert torch.allclose(torch.tensor(b_rows), checkpoint_rows(model_b, EMBED, 2)) and b_rows != a_rows.json()
    assert assert_memory_idle(client)["weight_version"] == "1"
    assert client.get("/model_info").json()["weight_version"] == "1"

    r = client.post("/update_weights_from_disk", json={"model_path": str(tiny_llama_dir), "weight_version": "v-a"})
    assert r.status_code == 200 and client.get("/server_info").json()["weight_version"] == "v-a"
    missing = client.post("/get_weights_by_name", json={"name": "no.such.weight"})
    assert missing.status_code == 400 and "no.such.weight" in missing.text


def test_update_waits_for_running_requests_or_aborts_them(client, tiny_llama_dir, model_b):
    """A request running when the update arrives finishes on the old weights alone (no
    mixed tokens); with abort_all_requests it is aborted instead."""
    long_body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 150, "ignore_eos": True},
        "stream": True,
    }
    # The module's earlier tests leave model A serving.
    for path, abort in ((model_b, False), (tiny_llama_dir, True)):
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(stream_events, client, "/generate", long_body)
            wait_running(client)
            r = client.post("/update_weights_from_disk", json={"model_path": str(path), "abort_all_requests": abort})
            assert r.status_code == 200, r.text
            events = running.result()
        last = events[-1]["meta_info"]
        if abort:
            assert last["finish_reason"]["type"] == "abort", last
        else:
            assert last["finish_reason"]["type"] == "length", last
            # all from model A (streamed chunks are cumulative: the last holds every id)
            assert events[-1]["output_ids"] == hf_reference.greedy_ids(tiny_llama_dir, PROMPT, 150, min_new_tokens=150)
            assert len({e["meta_info"]["weight_version"] for e in events}) == 1
    assert_memory_idle(client)


def wait_running(client, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while client.get("/server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_update_from_gguf_files(client, tiny_llama_dir, model_b, tiny_mqa_dir, tmp_path):
    """Model B as an F32 GGUF file (exactly B's weights: B's outputs), then model A as an
    F16 one (its outputs in this process); /get_weights_by_name reads the served file;
    a GGUF file of another shape is refused and B keeps serving."""
    b_file = write_gguf(model_b, tmp_path / "b.gguf", "F32")
    a_file = write_gguf(tiny_llama_dir, tmp_path / "a.gguf", "F16")
    other = write_gguf(tiny_mqa_dir, tmp_path / "mqa.gguf", "F32")

    def served_rows(name: str) -> torch.Tensor:
        r = client.post("/get_weights_by_name", json={"name": name, "truncate_size": 2})
        assert r.status_code == 200, r.text
        return torch.tensor(r.json())

    def file_rows(path, name: str) -> torch.Tensor:
        return dict(iterate_gguf_weights(str(path), show_progress=False))[name][:2]

    r = client.post("/update_weights_from_disk", json={"model_path": str(b_file)})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    b_ids = hf_reference.greedy_ids(model_b, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert greedy(client)["output_ids"] == b_ids
    for name in (EMBED, "lm_head.weight", "model.layers.1.self_attn.k_proj.weight"):  # k: un-permuted rows
        assert torch.equal(served_rows(name), checkpoint_rows(model_b, name, 2)), name

    r = client.post("/update_weights_from_disk", json={"model_path": str(other)})
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and "num_key_value_heads (1)" in r.json()["message"], r.json()
    assert greedy(client)["output_ids"] == b_ids

    r = client.post("/update_weights_from_disk", json={"model_path": str(a_file), "weight_version": "a-f16"})
    assert r.status_code == 200, r.text
    a_ids = greedy_steps(make_runner(a_file, dtype="float32"), [PROMPT], NEW_TOKENS)[0][0]
    out = greedy(client)
    assert out["output_ids"] == a_ids and out["meta_info"]["weight_version"] == "a-f16"
    assert torch.equal(served_rows(EMBED), file_rows(a_file, EMBED))
    assert client.post("/update_weights_from_disk", json={"model_path": str(tiny_llama_dir)}).status_code == 200
    assert_memory_idle(client)


def truncated_copy(model_dir, dest, name: str):
    """`model_dir` with tensor `name` cut to its first half of rows: the config still
    matches, and under --tp-size 2 rank 0 finds its rows while rank 1 finds none."""
    shutil.copytree(model_dir, dest)
    tensors = load_file(str(model_dir / "model.safetensors"))
    tensors[name] = tensors[name][: tensors[name].shape[0] // 2].clone()
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def test_updates_under_tensor_parallelism(tiny_llama_dir, model_b, tmp_path):
    """With --tp-size 2 (the offline Engine: the same scheduler path as the routes) every
    rank takes its shard of model B's tensors; an update that fails on rank 1 only
    leaves every rank on the old weights and says which rank failed; only rank 0 answers."""
    from tandem import Engine

    def engine_greedy(engine) -> list[int]:
        return engine.generate(
            input_ids=PROMPT, sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
        )["output_ids"]

    a_ids = hf_reference.greedy_ids(tiny_llama_dir, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    b_ids = hf_reference.greedy_ids(model_b, PROMPT, NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    b_tensors = load_file(str(model_b / "model.safetensors"))
    broken = truncated_copy(tiny_llama_dir, tmp_path / "broken", "model.layers.0.mlp.gate_proj.weight")
    with Engine(model_path=str(tiny_llama_dir), tp_size=2) as engine:
        assert engine_greedy(engine) == a_ids
        ok, message = engine.update_weights_from_tensor(list(b_tensors.items()))
        assert ok, message
        assert engine_greedy(engine) == b_ids
        assert torch.allclose(torch.tensor(engine.get_weights_by_name(EMBED, 2)), b_tensors[EMBED][:2])

        ok, message = engine.update_weights_from_disk(str(broken))
        assert not ok and "TP rank 1" in message and "kept" in message, message
        assert engine_greedy(engine) == b_ids
        assert engine.get_server_info()["weight_version"] == "1"

        assert engine.update_weights_from_disk(str(tiny_llama_dir))[0]
        assert engine_greedy(engine) == a_ids
        info = engine.get_server_info()
        assert info["free_kv_slots"] + info["evictable_cached_slots"] == info["max_total_num_tokens"], info
