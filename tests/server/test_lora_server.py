"""Multi-LoRA serving through HTTP (one server, --lora-paths a and b, two slots):
/generate with `lora_path` (one name, or one per prompt of a batch) gives PEFT's greedy
tokens; the OpenAI routes take `model: "<base>:<adapter>"` and /v1/models lists the
adapters; an unknown adapter is a 400 naming it; /load_lora_adapter and
/unload_lora_adapter while another request streams (an unload of the adapter it uses is
a 409 naming it; after an unload and a reload the outputs are the same)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from http_helpers import assert_memory_idle, generate
from lora_adapters import peft_reference, save_random_adapter
from runner_steps import hf_greedy
from server_launcher import ServerHandle

PROMPT = [1, 17, 42, 99, 7, 23]
STEPS = 8
PARAMS = {"temperature": 0, "max_new_tokens": STEPS, "ignore_eos": True}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-server")
    specs = {
        "a": dict(rank=8, alpha=16, targets=["q_proj", "k_proj", "v_proj", "o_proj"], seed=11),
        "b": dict(rank=4, alpha=4, targets=["gate_proj", "up_proj", "down_proj"], seed=12),
        "c": dict(rank=8, alpha=8, targets=["q_proj", "down_proj"], seed=13),
    }
    return {n: str(save_random_adapter(tiny_llama_dir, root / n, **s)) for n, s in specs.items()}


@pytest.fixture(scope="module")
def want(tiny_llama_dir, adapters):
    """PEFT's greedy tokens for PROMPT under each adapter."""
    return {n: hf_greedy(peft_reference(tiny_llama_dir, p), PROMPT, STEPS)[0] for n, p in adapters.items()}


@pytest.fixture(scope="module")
def client(tiny_llama_dir, adapters):
    args = ["--lora-paths", f"a={adapters['a']}", f"b={adapters['b']}", "--max-loras-per-batch", "2"]
    args += ["--max-lora-rank", "8", "--served-model-name", "tiny"]
    with ServerHandle(tiny_llama_dir, args) as handle, httpx.Client(base_url=handle.base_url, timeout=120) as c:
        yield c


def _ids(client, lora_path, **extra) -> list[int]:
    return generate(client, input_ids=PROMPT, sampling_params=PARAMS, lora_path=lora_path, **extra)["output_ids"]


def test_generate_with_adapters_matches_peft(client, want):
    base = _ids(client, None)
    assert _ids(client, "a") == want["a"] and _ids(client, "b") == want["b"] and want["a"] != base
    batch = generate(client, input_ids=[PROMPT] * 3, sampling_params=PARAMS, lora_path=["b", None, "a"])
    assert [r["output_ids"] for r in batch] == [want["b"], base, want["a"]]
    assert_memory_idle(client)


def test_openai_routes_and_model_list(client, want, adapters):
    texts = {}
    for model in ("tiny:a", "tiny"):
        body = {"model": model, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "max_tokens": STEPS}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        texts[model] = r.json()["choices"][0]["text"]
    assert texts["tiny:a"] == generate(client, input_ids=PROMPT, sampling_params=PARAMS, lora_path="a")["text"]
    assert texts["tiny"] != texts["tiny:a"]
    models = {m["id"]: m for m in client.get("/v1/models").json()["data"]}
    assert models["a"]["root"] == adapters["a"] and models["a"]["parent"] == "tiny" and "b" in models


def test_unknown_adapter_is_a_400_naming_it(client):
    r = client.post("/generate", json={"input_ids": PROMPT, "sampling_params": PARAMS, "lora_path": "nope"})
    assert r.status_code == 400 and "'nope'" in r.text, r.text
    r = client.post("/v1/chat/completions", json={"model": "tiny:nope", "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and "'nope'" in r.text, r.text
    r = client.post("/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/dir"})
    assert r.status_code == 400 and r.json()["success"] is False and "adapter_config.json" in r.json()["error_message"]


def test_load_unload_reload_while_serving(client, want, adapters):
    long = {"input_ids": PROMPT, "sampling_params": {**PARAMS, "max_new_tokens": 400}, "lora_path": "a", "stream": True}
    started, events = threading.Event(), []

    def stream():
        with client.stream("POST", "/generate", json=long) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    events.append(line)

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    r = client.post("/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"a", "b", "c"}, r.text
    assert _ids(client, "c") == want["c"]
    busy = client.post("/unload_lora_adapter", json={"lora_name": "a"})
    running = t.is_alive()
    t.join(120)
    if running:  # the stream was still decoding with "a": refused, naming its request
        assert busy.status_code == 409 and len(busy.json()["in_use"]) == 1, busy.text
        r = client.post("/unload_lora_adapter", json={"lora_name": "a"})
    else:
        r = busy
    assert r.status_code == 200 and set(r.json()["loaded_adapters"]) == {"b", "c"}, r.text
    assert len(events) > 1 and json.loads(events[-1][len("data: ") :])["meta_info"]["finish_reason"]["type"] == "length"
    assert client.post("/generate", json={"input_ids": PROMPT, "lora_path": "a"}).status_code == 400
    r = client.post("/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["a"]})
    assert r.status_code == 200, r.text
    assert _ids(client, "a") == want["a"]
    assert client.post("/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    assert_memory_idle(client)
