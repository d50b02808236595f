"""SGLang's own clients against Tandem: the request bodies they send (recorded once from
SGLang 0.5.23's frontend language and bench_serving, tests/fixtures/sglang_clients) are
replayed, and each answer must be what that client reads. Also SGLang's information and
control routes, and meta_info as SGLang names it."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent.parent / "fixtures" / "sglang_clients"


def _requests(name: str, **substitutions: str) -> list[dict]:
    text = (FIXTURES / name).read_text()
    for key, value in substitutions.items():
        text = text.replace("{" + key + "}", value)
    return json.loads(text)["requests"]


def _send(client, req: dict):
    return client.request(req["method"], req["path"], params=req["query"], json=req["body"])


def _sse(response) -> list[dict]:
    lines = [ln for ln in response.text.split("\n") if ln.startswith("data:")]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[5:]) for ln in lines[:-1]]


def test_frontend_connect_reads_model_path(client, tiny_llama_dir):
    [req] = _requests("frontend_connect.json")
    r = _send(client, req)
    assert r.status_code == 200 and r.json()["model_path"] == str(tiny_llama_dir)


@pytest.mark.parametrize("name", ["frontend_gen_stop.json", "frontend_chat.json"])
def test_frontend_gen(client, name):
    """RuntimeEndpoint.generate reads obj["text"] and obj["meta_info"]; it sends regex,
    json_schema (null) and stop_regex ([]) with every gen."""
    [req] = _requests(name)
    assert req["body"]["sampling_params"]["stop_regex"] == [] and req["body"]["sampling_params"]["regex"] is None
    r = _send(client, req)
    assert r.status_code == 200, r.text
    out = r.json()
    assert isinstance(out["text"], str) and out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    if "." in req["body"]["sampling_params"]["stop"]:
        assert "." not in out["text"] and "\n" not in out["text"]


def test_frontend_select_gets_prompt_logprobs_with_text(client):
    """select: a prefix request whose meta_info.prompt_tokens sets logprob_start_len, then
    one batch with every choice; it reads input_token_logprobs[i][0][-1] (text) and
    averages the non-null logprobs."""
    prefix, batch = _requests("frontend_select.json")
    r = _send(client, prefix)
    assert r.status_code == 200, r.text
    prompt_len = r.json()["meta_info"]["prompt_tokens"]
    assert batch["body"]["logprob_start_len"] == max(prompt_len - 2, 0)
    r = _send(client, batch)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert len(outs) == len(batch["body"]["text"])
    for out in outs:
        meta = out["meta_info"]
        entries = meta["input_token_logprobs"]
        assert len(entries) == meta["prompt_tokens"] - batch["body"]["logprob_start_len"]
        assert all(len(e) == 3 and isinstance(e[2], str) for e in entries)
        assert [e[0] for e in entries if e[0]], "select averages the non-null logprobs"
        assert meta["output_token_logprobs"] == []
        assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta


def test_frontend_stream_chunks_are_cumulative(client):
    """generate_stream slices data["text"][pos:], so every chunk holds the text so far."""
    [req] = _requests("frontend_stream.json")
    r = _send(client, req)
    assert r.status_code == 200, r.text
    chunks = _sse(r)
    assert chunks
    for prev, cur in zip(chunks, chunks[1:]):
        assert cur["text"].startswith(prev["text"])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None


def test_bench_serving_generate(client):
    """bench_serving --backend sglang sends lora_path: null, return_routed_experts: false;
    it reads text and meta_info.completion_tokens of each streamed chunk."""
    [req] = _requests("bench_serving_generate.json")
    assert req["body"]["lora_path"] is None
    r = _send(client, req)
    assert r.status_code == 200, r.text
    chunks = _sse(r)
    assert chunks[-1]["meta_info"]["completion_tokens"] == req["body"]["sampling_params"]["max_new_tokens"]
    assert all(isinstance(c["text"], str) for c in chunks)


def test_bench_serving_control_routes_and_profile_trace(client, tmp_path):
    """bench_serving --flush-cache --profile: /v1/models, /flush_cache?timeout=,
    /start_profile with output_dir, /stop_profile (the trace is written there), /server_info."""
    for req in _requests("bench_serving_control.json", output_dir=str(tmp_path)):
        r = _send(client, req)
        assert r.status_code == 200, (req["path"], r.text)
        if req["path"] == "/start_profile":
            assert (
                client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}}).status_code
                == 200
            )
        if req["path"] == "/server_info":
            info = r.json()
            assert isinstance(info["internal_states"], list) and info["internal_states"][0]["num_running_reqs"] == 0
            assert 0.0 <= info["internal_states"][0]["forward_idle_fraction"] < 1.0  # a forward ran (#10)
            assert info["version"]
    [trace] = tmp_path.glob("*-TP-0.trace.json.gz")
    assert json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_profile_errors_are_400(client, tmp_path):
    r = client.post("/stop_profile")
    assert r.status_code == 400 and "not in progress" in r.json()["error"]["message"]
    assert client.get("/start_profile", params={}).status_code == 200  # GET, no body: the default dir
    r = client.post("/start_profile", json={"output_dir": str(tmp_path)})
    assert r.status_code == 400 and "already in progress" in r.json()["error"]["message"]
    assert client.get("/stop_profile").status_code == 200
    r = client.post("/start_profile", json={"output_dir": str(tmp_path), "num_steps": 2, "profile_prefix": "p"})
    assert r.status_code == 200
    client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
    assert len(list(tmp_path.glob("p-*-TP-0.trace.json.gz"))) == 1, "num_steps stops by itself"
    assert client.post("/stop_profile").status_code == 400


def test_sglang_information_routes(client, tiny_llama_dir):
    info = client.get("/get_model_info").json()
    assert info == client.get("/model_info").json()
    assert info["model_type"] == "llama" and info["architectures"] == ["LlamaForCausalLM"]
    assert info["is_generation"] is True and info["load_format"] == "auto" and info["weight_version"] == "default"
    server = client.get("/get_server_info").json()
    assert server["model_path"] == str(tiny_llama_dir) and "internal_states" in server and "version" in server
    assert client.get("/ping").status_code == 200
    loads = client.get("/v1/loads").json()
    [load] = loads["loads"]
    assert load["dp_rank"] == 0 and load["num_running_reqs"] == 0 and load["max_total_num_tokens"] > 0
    assert loads["version"] == server["version"]
    assert client.get("/flush_cache").status_code == 200
    assert client.post("/flush_cache").status_code == 200


def test_meta_info_keys_are_sglangs(client):
    r = client.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 3}, "return_logprob": True, "stream": True},
    )
    chunks = _sse(r)
    assert all("e2e_latency" not in c["meta_info"] for c in chunks[:-1]), "only the finished output has it"
    final = chunks[-1]["meta_info"]
    assert final["num_retractions"] == 0 and "retractions" not in final and final["e2e_latency"] > 0
    assert "output_top_logprobs" not in final and "input_top_logprobs" not in final
    assert len(final["output_token_logprobs"]) == 3
    r = client.post(
        "/generate",
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2}, "return_logprob": True, "top_logprobs_num": 2},
    )
    meta = r.json()["meta_info"]
    assert [len(t) for t in meta["output_top_logprobs"]] == [2, 2]


def test_sglang_fields_accepted_or_named(client):
    ok = {
        "text": "Hi",
        "sampling_params": {
            "max_new_tokens": 2,
            "min_new_tokens": 1,  # bans the stop ids below while it lasts
            "stop_token_ids": [119690],  # Llama-3's id, past the tiny vocabulary: ignored, as SGLang
            "regex": None,
            "json_schema": "",
            "ebnf": None,
            "structural_tag": None,
            "stop_regex": [],
            "logit_bias": {},
            "custom_params": None,
            "beam_width": None,
            "stream_interval": None,
        },
        "lora_path": None,
        "image_data": None,
        "return_hidden_states": False,
        "session_id": "s1",
        "priority": 3,
        "custom_labels": {"a": "b"},
        "some_future_field": 1,
    }
    assert client.post("/generate", json=ok).status_code == 200
    bad = [
        (
            {"sampling_params": {"structural_tag": "{}"}},
            "sampling_params.structural_tag: invalid structural_tag: needs 'format'",
        ),
        ({"sampling_params": {"regex": "[a-"}}, "sampling_params.regex: invalid regex"),
        ({"sampling_params": {"stop_regex": ["x+", "(x"]}}, "sampling_params.stop_regex: invalid regex"),
        ({"sampling_params": {"nonsense": 1}}, "sampling_params.nonsense: unknown"),
        ({"lora_path": "adapter-a"}, "lora_path: LoRA is not enabled on this server"),
        ({"image_data": "http://x/y.png"}, "image_data: image input is not supported yet"),
        ({"return_hidden_states": True}, "return_hidden_states:"),
    ]
    for extra, message in bad:
        r = client.post("/generate", json={"text": "Hi", **extra})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), (extra, r.text)


def test_openai_serves_any_model_name(client):
    r = client.post(
        "/v1/chat/completions",
        json={"model": "default", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 200 and r.json()["model"] == "default"
    r = client.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["code"] == 400 and "'role' must be one of" in r.json()["message"]
