"""The OpenAI-compatible layer without a server: request -> GenerateReqInput conversion,
validation and error shapes, and outputs -> responses/chunks, using hand-made output
dicts and a fake tokenizer manager that follows the manager's contract (B*n streams,
incremental chunks, logprob lists in meta_info)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from tandem.entrypoints.openai.common import reject_unsupported, resolve_max_tokens, usage_of
from tandem.entrypoints.openai.errors import OpenAIError, from_value_error
from tandem.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from tandem.entrypoints.openai.router import add_api_key_middleware, add_openai_routes
from tandem.entrypoints.openai.serving_chat import (
    ChatStreamConverter,
    build_chat_generate_input,
    build_chat_response,
    encode_chat_prompt,
    render_chat_prompt,
)
from tandem.entrypoints.openai.serving_completions import (
    CompletionStreamConverter,
    Prompt,
    build_completion_generate_input,
    build_completion_response,
    split_prompts,
    tokenize_prompts,
)
from tandem.server_args import ServerArgs
from tandem.tokenizer.text_encoder import TextEncoder

MODEL = "tiny"


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


@pytest.fixture(scope="module")
def encoder(tokenizer):
    enc = TextEncoder(tokenizer)
    yield enc
    enc.close()


def _args(**kw) -> ServerArgs:
    return ServerArgs(model_path="/models/tiny-llama", served_model_name=MODEL, device="cpu", **kw)


def _chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "Hi"}], **kw)


# ---- request conversion --------------------------------------------------------------


def test_chat_defaults_follow_openai():
    obj = build_chat_generate_input(_chat(), [1, 2, 3], max_new_tokens=50)
    assert obj.input_ids == [1, 2, 3]
    assert obj.sampling_params == {"max_new_tokens": 50, "temperature": 1.0, "top_p": 1.0, "n": 1}
    assert obj.stream is False and obj.return_logprob is False


def test_chat_fields_map_to_sglang_names():
    req = _chat(
        temperature=0,
        top_p=0.5,
        n=3,
        stop="END",
        seed=7,
        stream=True,
        logprobs=True,
        top_logprobs=4,
        top_k=5,
        min_p=0.1,
        ignore_eos=True,
        stop_token_ids=[2],
        skip_special_tokens=False,
        no_stop_trim=True,
    )
    obj = build_chat_generate_input(req, [1], max_new_tokens=8)
    assert obj.sampling_params == {
        "max_new_tokens": 8,
        "temperature": 0.0,
        "top_p": 0.5,
        "n": 3,
        "stop": ["END"],
        "sampling_seed": 7,
        "top_k": 5,
        "min_p": 0.1,
        "ignore_eos": True,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
    }
    assert obj.stream and obj.return_logprob and obj.top_logprobs_num == 4 and obj.return_text_in_logprobs


def test_max_tokens_budget():
    assert resolve_max_tokens(None, 10, 128, None, "max_tokens", "messages") == 118
    assert resolve_max_tokens(None, 120, 128, 16, "max_tokens", "prompt") == 8
    assert resolve_max_tokens(5, 10, 128, 16, "max_tokens", "prompt") == 5
    # SGLang's wording, which its clients and tests match on: more than the context alone ...
    with pytest.raises(OpenAIError) as e:
        resolve_max_tokens(200, 10, 128, None, "max_completion_tokens", "messages")
    assert e.value.param == "max_completion_tokens" and e.value.status == 400
    assert e.value.message == (
        "max_completion_tokens is too large: 200. This model supports at most 128 completion tokens."
    )
    # ... and more than fits beside the prompt.
    with pytest.raises(OpenAIError) as e:
        resolve_max_tokens(120, 10, 128, None, "max_tokens", "messages")
    assert e.value.param == "max_tokens" and e.value.status == 400
    assert e.value.message.startswith(
        "Requested token count exceeds the model's maximum context length of 128 "
        "tokens. You requested a total of 130 tokens: 10 tokens"
    )
    with pytest.raises(OpenAIError) as e:
        resolve_max_tokens(None, 128, 128, None, "max_tokens", "messages")
    assert e.value.param == "messages"
    assert e.value.message == "The input (128 tokens) is longer than the model's context length (128 tokens)."


@pytest.mark.parametrize(
    "field,value,ok",
    [
        ("frequency_penalty", 0.5, True),
        ("presence_penalty", -1.0, True),
        ("repetition_penalty", 1.2, True),
        ("logit_bias", {"5": 1.0}, False),
        ("logit_bias", {}, True),
        ("functions", [{"name": "f"}], False),
        ("tools", [], True),
        ("response_format", {"type": "json_object"}, True),
        ("response_format", {"type": "text"}, True),
        ("tool_choice", "none", True),
    ],
)
def test_unsupported_fields(field, value, ok):
    req = _chat(**{field: value})
    if ok:
        reject_unsupported(req)
    else:
        with pytest.raises(OpenAIError) as e:
            reject_unsupported(req)
        assert e.value.param == field and "not supported yet" in e.value.message


def test_error_code_is_the_numeric_status():
    assert OpenAIError("x", 400).to_dict()["code"] == 400
    assert OpenAIError("x", 503).to_dict()["code"] == 503


@pytest.mark.parametrize(
    "role,ok", [("user", True), ("SYSTEM", True), ("developer", True), ("tool", True), ("wizard", False), ("", False)]
)
def test_chat_roles_are_sglangs(role, ok):
    if ok:
        assert ChatMessage(role=role, content="hi").role == role.lower()
    else:
        with pytest.raises(ValidationError, match="'role' must be one of"):
            ChatMessage(role=role, content="hi")


def test_value_error_names_openai_field():
    err = from_value_error(ValueError("sampling_params.max_new_tokens: must be >= 0, got -1"))
    assert err.param == "max_tokens" and err.message.startswith("max_tokens:")
    err = from_value_error(ValueError("input_ids: token id 9999 is outside the vocabulary"), {"input_ids": "prompt"})
    assert err.param == "prompt"
    assert from_value_error(ValueError("something odd happened")).param is None


def test_chat_template_and_bos(tokenizer, encoder):
    text = render_chat_prompt(tokenizer, _chat().messages)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    # The ids apply_chat_template(tokenize=True) gives (SGLang's): only the template's
    # special tokens, so no BOS here, where the tokenizer alone would add one.
    messages = [m.model_dump(exclude_none=True) for m in _chat().messages]
    expected = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert asyncio.run(encode_chat_prompt(encoder, text)) == expected
    assert tokenizer.bos_token_id not in expected and tokenizer.encode(text)[0] == tokenizer.bos_token_id
    # A template that writes BOS itself gets exactly that one.
    template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    text = render_chat_prompt(tokenizer, _chat().messages, template)
    assert text.startswith("<s>")
    assert asyncio.run(encode_chat_prompt(encoder, text)).count(tokenizer.bos_token_id) == 1


def test_chat_content_parts(tokenizer):
    req = ChatCompletionRequest(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}],
    )
    assert "user\nHello<|im_end|>" in render_chat_prompt(tokenizer, req.messages)
    req = ChatCompletionRequest(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    )
    with pytest.raises(OpenAIError) as e:
        render_chat_prompt(tokenizer, req.messages)
    assert e.value.status == 400 and "image_url" in e.value.message


def test_chat_without_tokenizer_is_400():
    with pytest.raises(OpenAIError) as e:
        render_chat_prompt(None, _chat().messages)
    assert "without a tokenizer" in e.value.message


def test_completion_prompt_forms(tokenizer, encoder):
    assert split_prompts("ab") == ["ab"]
    assert split_prompts(["a", "b"]) == ["a", "b"]
    assert split_prompts([5, 6]) == [[5, 6]]
    assert split_prompts([[5], [6, 7]]) == [[5], [6, 7]]
    for bad in ([], [[]], [""]):
        with pytest.raises(OpenAIError):
            split_prompts(bad)
    prompts = asyncio.run(tokenize_prompts(encoder, ["Hello", [600, 922]]))
    assert prompts[0].input_ids == tokenizer.encode("Hello") and prompts[0].text == "Hello"
    assert prompts[1].input_ids == [600, 922] and prompts[1].text == tokenizer.decode([600, 922])
    with pytest.raises(OpenAIError):
        asyncio.run(tokenize_prompts(None, ["Hello"]))
    assert asyncio.run(tokenize_prompts(None, [[5]]))[0].text == ""


def test_completion_generate_input():
    req = CompletionRequest(model=MODEL, prompt="x", seed=3, logprobs=2, echo=True, stop=["a", "b"])
    obj = build_completion_generate_input(req, [Prompt([1, 2], "x")], context_len=10)
    assert obj.input_ids == [1, 2] and obj.sampling_params["max_new_tokens"] == 8  # default 16, capped
    assert obj.sampling_params["stop"] == ["a", "b"] and obj.sampling_params["sampling_seed"] == 3
    assert obj.return_logprob and obj.top_logprobs_num == 2 and obj.logprob_start_len == 0
    req = CompletionRequest(model=MODEL, prompt=[[1], [2, 3]], max_tokens=4)
    obj = build_completion_generate_input(req, [Prompt([1], ""), Prompt([2, 3], "")], context_len=10)
    assert obj.input_ids == [[1], [2, 3]] and [p["max_new_tokens"] for p in obj.sampling_params] == [4, 4]
    assert obj.return_logprob is False and obj.logprob_start_len == -1


def test_request_validation_types():
    with pytest.raises(ValueError):
        CompletionRequest(model=MODEL, prompt=[1, "a"])
    with pytest.raises(ValueError):
        _chat(temperature=-1)
    with pytest.raises(ValueError):
        _chat(top_logprobs=21)
    with pytest.raises(ValueError):
        CompletionRequest(model=MODEL, prompt="x", logprobs=6)
    with pytest.raises(ValueError):
        ChatCompletionRequest(model=MODEL, messages=[])


# ---- outputs -> responses ------------------------------------------------------------


def _meta(prompt_tokens, completion_tokens, finish=None, **extra):
    return {
        "id": "r",
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "cached_tokens": 0,
        "e2e_latency": 0.1,
        **extra,
    }


def test_usage_counts_each_prompt_once():
    metas = [_meta(5, 3), _meta(5, 4), _meta(7, 1), _meta(7, 2)]
    u = usage_of(metas, n=2)
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens) == (12, 10, 22)


def test_chat_response_shape_with_logprobs():
    lp = {
        "output_token_logprobs": [[-0.25, 10, "Hi"], [float("-inf"), 11, "!"]],
        "output_top_logprobs": [[[-0.25, 10, "Hi"], [-2.0, 12, "Yo"]], [[-0.5, 13, "?"]]],
    }
    outputs = [
        {"text": "Hi!", "output_ids": [10, 11], "meta_info": _meta(6, 2, {"type": "stop", "matched": 2}, **lp)},
        {"text": "Hey", "output_ids": [14], "meta_info": _meta(6, 1, {"type": "length", "length": 1}, **lp)},
    ]
    resp = build_chat_response("chatcmpl-1", MODEL, outputs, n=2, with_logprobs=True).model_dump()
    assert resp["object"] == "chat.completion" and resp["model"] == MODEL
    assert resp["usage"] == {"prompt_tokens": 6, "completion_tokens": 3, "total_tokens": 9}
    c0, c1 = resp["choices"]
    assert (
        c0["message"] == {"role": "assistant", "content": "Hi!", "reasoning_content": None}
        and c0["finish_reason"] == "stop"
    )
    assert c1["index"] == 1 and c1["finish_reason"] == "length"
    assert (c0["matched_stop"], c1["matched_stop"]) == (2, None)  # SGLang's: the EOS id; none on length
    first = c0["logprobs"]["content"][0]
    assert first["token"] == "Hi" and first["logprob"] == -0.25 and first["bytes"] == [72, 105]
    assert [t["token"] for t in first["top_logprobs"]] == ["Hi", "Yo"]
    assert c0["logprobs"]["content"][1]["logprob"] == -9999.0
    assert build_chat_response("x", MODEL, outputs, 2, with_logprobs=False).choices[0].logprobs is None


def test_chat_stream_chunks():
    conv = ChatStreamConverter("chatcmpl-1", MODEL, num_choices=2, n=2, with_logprobs=False, include_usage=True)
    chunks = conv.start()
    chunks += conv.on_output(0, {"text": "He", "output_ids": [1], "meta_info": _meta(4, 1)})
    chunks += conv.on_output(1, {"text": "", "output_ids": [2], "meta_info": _meta(4, 1)})  # held back: no chunk
    chunks += conv.on_output(
        0, {"text": "y", "output_ids": [3], "meta_info": _meta(4, 2, {"type": "length", "length": 2})}
    )
    chunks += conv.on_output(
        1, {"text": "Yo", "output_ids": [4], "meta_info": _meta(4, 2, {"type": "stop", "matched": 2})}
    )
    chunks += conv.end()
    assert all(
        c["object"] == "chat.completion.chunk"
        and c["id"] == "chatcmpl-1"
        and c["model"] == MODEL
        and isinstance(c["created"], int)
        for c in chunks
    )
    # SGLang's deltas: role and content when set, reasoning_content always (null).
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": "", "reasoning_content": None}
    ] * 2
    for i, text, reason, matched in ((0, "Hey", "length", None), (1, "Yo", "stop", 2)):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert "".join(ch["delta"].get("content", "") for ch in mine) == text
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == [reason]
        assert mine[-1]["delta"] == {"reasoning_content": None} and mine[-1]["matched_stop"] == matched
        assert all(ch["matched_stop"] is None for ch in mine[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["total_tokens"] == 8
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_response_echo_and_offsets():
    meta = _meta(
        2,
        2,
        {"type": "length", "length": 2},
        input_token_logprobs=[[None, 1, "<s>"], [-1.0, 600, "Hello"]],
        input_top_logprobs=[None, [[-1.0, 600, "Hello"]]],
        output_token_logprobs=[[-0.5, 7, " a"], [-0.75, 8, "b"]],
        output_top_logprobs=[[[-0.5, 7, " a"]], [[-0.75, 8, "b"]]],
    )
    outputs = [{"text": " ab", "output_ids": [7, 8], "meta_info": meta}]
    resp = build_completion_response(
        "cmpl-1", MODEL, outputs, [Prompt([1, 600], "Hello")], n=1, echo=True, with_logprobs=True
    ).model_dump()
    choice = resp["choices"][0]
    assert choice["text"] == "Hello ab" and resp["object"] == "text_completion"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["<s>", "Hello", " a", "b"]
    assert lp["token_logprobs"] == [None, -1.0, -0.5, -0.75]
    assert lp["top_logprobs"] == [None, {"Hello": -1.0}, {" a": -0.5}, {"b": -0.75}]
    assert lp["text_offset"] == [0, 3, 8, 10]


def test_completion_stream_chunks():
    conv = CompletionStreamConverter(
        "cmpl-1", MODEL, [Prompt([1], "P")], n=1, echo=True, with_logprobs=False, include_usage=False
    )
    chunks = conv.on_output(0, {"text": "a", "output_ids": [5], "meta_info": _meta(1, 1)})
    chunks += conv.on_output(
        0, {"text": "b", "output_ids": [6], "meta_info": _meta(1, 2, {"type": "stop", "matched": 6})}
    )
    chunks += conv.end()
    # As SGLang: the finish rides on the last output's chunk, with its matched stop.
    assert [c["choices"][0]["text"] for c in chunks] == ["Pa", "b"]
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, "stop"]
    assert [c["choices"][0]["matched_stop"] for c in chunks] == [None, 6]
    assert all("usage" not in c and c["object"] == "text_completion" for c in chunks)


# ---- the routes over a fake tokenizer manager ------------------------------------------


class FakeTM:
    """Follows the TokenizerManager contract: B*n streams, prompt-major, logprobs in meta."""

    PIECES = ["A", "b", "c"]

    def __init__(self, tokenizer, context_len=64):
        self.tokenizer, self.context_len, self.vocab_size = tokenizer, context_len, 1536
        self.text_encoder = TextEncoder(tokenizer)
        self.server_args = _args()
        self.scheduler_info = {"context_length": context_len, "vocab_size": 1536}  # what the scheduler reports
        self.lora_adapters = {}  # LoRA adapters loaded (none)
        self.requests = []

    async def generate_request(self, obj, incremental=False):
        obj.validate_shape()
        self.requests.append(obj)
        items = [obj.item(i) for i in range(obj.batch_size)] if obj.is_batch else [obj]
        streams = []
        for item in items:
            n = item.sampling_params.get("n", 1)
            if item.sampling_params.get("temperature", 1.0) < 0:
                raise ValueError("sampling_params.temperature: must be >= 0")
            for s in range(n):
                streams.append(self._stream(item, s, incremental))
        return streams

    async def _stream(self, item, s, incremental):
        limit = min(item.sampling_params["max_new_tokens"], len(self.PIECES))
        pieces = [f"{p}{s}" if k == 0 else p for k, p in enumerate(self.PIECES[:limit])]
        entries = [[-0.5 * (k + 1), 100 + k, p] for k, p in enumerate(pieces)]
        tops = [[e, [-3.0, 7, "z"]][: item.top_logprobs_num] for e in entries]
        prompt = len(item.input_ids)
        for k in range(limit):
            fin = {"type": "length", "length": limit} if k == limit - 1 else None
            lo = k if (incremental and item.stream) else 0
            meta = _meta(prompt, k + 1, fin)
            if item.return_logprob:
                meta.update(output_token_logprobs=entries[lo : k + 1], output_top_logprobs=tops[lo : k + 1])
                if item.logprob_start_len == 0 and (lo == 0):
                    meta.update(
                        input_token_logprobs=[[None, item.input_ids[0], "p"]]
                        + [[-1.0, t, "q"] for t in item.input_ids[1:]],
                        input_top_logprobs=[None] * prompt,
                    )
            if item.stream or fin:
                yield {"text": "".join(pieces[lo : k + 1]), "output_ids": list(range(lo, k + 1)), "meta_info": meta}


@pytest.fixture
def fake_app(tokenizer):
    tm = FakeTM(tokenizer)
    app = FastAPI()
    add_openai_routes(app, tm, tm.server_args)
    return app, tm


def _client(app, api_key="k"):
    return openai.OpenAI(base_url="http://testserver/v1", api_key=api_key, http_client=TestClient(app))


def test_fake_chat_n2_logprobs(fake_app):
    app, tm = fake_app
    resp = _client(app).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2, logprobs=True, top_logprobs=2, max_tokens=3
    )
    assert [c.message.content for c in resp.choices] == ["A0bc", "A1bc"]
    assert [c.finish_reason for c in resp.choices] == ["length", "length"]
    prompt_len = len(tm.requests[-1].input_ids)
    assert resp.usage.prompt_tokens == prompt_len and resp.usage.completion_tokens == 6
    content = resp.choices[1].logprobs.content
    assert [t.token for t in content] == ["A1", "b", "c"] and content[2].logprob == -1.5
    assert [t.token for t in content[0].top_logprobs] == ["A1", "z"]


def test_fake_chat_stream(fake_app):
    app, _ = fake_app
    stream = _client(app).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        n=2,
        stream=True,
        logprobs=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    texts, reasons, tokens = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
    for c in chunks[:-1]:
        (ch,) = c.choices
        texts[ch.index] += ch.delta.content or ""
        if ch.finish_reason:
            reasons[ch.index].append(ch.finish_reason)
        if ch.logprobs:
            tokens[ch.index] += [t.token for t in ch.logprobs.content]
    assert texts == {0: "A0bc", 1: "A1bc"} and reasons == {0: ["length"], 1: ["length"]}
    assert tokens == {0: ["A0", "b", "c"], 1: ["A1", "b", "c"]}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_fake_completions_batch_echo_stream(fake_app):
    app, tm = fake_app
    client = _client(app)
    resp = client.completions.create(model=MODEL, prompt=[[5, 6], [7]], n=2, max_tokens=2, echo=True, logprobs=1)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]

    def dec(ids):  # echoed ids are decoded without special tokens, as SGLang does
        return tm.tokenizer.decode(ids, skip_special_tokens=True)

    assert [c.text for c in resp.choices] == [
        dec([5, 6]) + "A0b",
        dec([5, 6]) + "A1b",
        dec([7]) + "A0b",
        dec([7]) + "A1b",
    ]
    assert resp.choices[0].logprobs.tokens == ["p", "q", "A0", "b"]
    assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 8
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", stream=True, logprobs=0))
    assert "".join(c.choices[0].text for c in chunks) == "A0bc"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices[0].logprobs) == 3
    # SGLang's test_completion_stream: with logprobs asked for, every chunk carries them.
    for echo in (False, True):
        chunks = list(client.completions.create(model=MODEL, prompt="Hello", stream=True, logprobs=2, echo=echo))
        assert all(c.choices[0].logprobs and c.choices[0].logprobs.tokens for c in chunks)
        assert all(len(c.choices[0].logprobs.top_logprobs[-1]) == 2 for c in chunks)


def test_fake_errors(fake_app):
    app, _ = fake_app
    http = TestClient(app)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
    cases = [
        ({**body, "temperature": -1}, "temperature"),
        ({**body, "temperature": "hot"}, "temperature"),
        ({**body, "logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"model": MODEL}, "messages"),
        ({**body, "messages": [{"content": "x"}]}, "messages.0.role"),
        ({**body, "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ]
    # SGLang's wording for budgets, which names no field.
    worded = [
        ({**body, "max_tokens": 10_000}, "max_tokens", "max_completion_tokens is too large: 10000"),
        ({**body, "max_tokens": 63}, "max_tokens", "Requested token count exceeds"),
        ({**body, "messages": [{"role": "user", "content": "x" * 400}]}, "messages", "is longer than"),
    ]
    for payload, param, text in [(p, q, q.split(".")[0]) for p, q in cases] + worded:
        r = http.post("/v1/chat/completions", json=payload)
        assert r.status_code == 400, (payload, r.text)
        err = r.json()
        assert err["object"] == "error" and err["param"] == param and text in err["message"]
        assert err["code"] == 400
    # Any model name is served, as in SGLang; the response echoes it.
    r = http.post("/v1/chat/completions", json={**body, "model": "default"})
    assert r.status_code == 200 and r.json()["model"] == "default"
    r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["message"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 99999]})
    assert r.status_code == 400 and r.json()["param"] == "prompt"
    r = http.get("/v1/nope")
    assert r.status_code == 404 and r.json()["object"] == "error"
    with pytest.raises(openai.BadRequestError) as e:
        _client(app).completions.create(model=MODEL, prompt="x", temperature=-1)
    assert e.value.status_code == 400


def test_fake_models_and_tokenize(fake_app):
    app, tm = fake_app
    client = _client(app)
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")
    http = TestClient(app)
    r = http.post("/tokenize", json={"text": "Hello"}).json()
    assert r == {
        "tokens": tm.tokenizer.encode("Hello"),
        "count": len(tm.tokenizer.encode("Hello")),
        "max_model_len": 64,
    }
    assert http.post("/tokenize", json={"prompt": "Hello", "add_special_tokens": False}).json()["tokens"][0] != 1
    assert http.post("/detokenize", json={"tokens": [600, 922]}).json() == {"text": tm.tokenizer.decode([600, 922])}
    assert http.post("/detokenize", json={"tokens": [99999]}).status_code == 400


def test_fake_tokenize_and_detokenize_as_sglang(fake_app):
    """SGLang's shapes: `prompt` lists, `add_special_tokens`, `skip_special_tokens`, /v1/ aliases."""
    app, tm = fake_app
    http, tok = TestClient(app), tm.tokenizer
    for route in ("/tokenize", "/v1/tokenize"):
        r = http.post(route, json={"prompt": ["Hello", "a b"]}).json()
        assert r == {
            "tokens": [tok.encode("Hello"), tok.encode("a b")],
            "count": [len(tok.encode("Hello")), len(tok.encode("a b"))],
            "max_model_len": 64,
        }
        r = http.post(route, json={"prompt": "Hello", "add_special_tokens": False}).json()
        assert r["tokens"] == tok.encode("Hello", add_special_tokens=False) and r["tokens"][0] != tok.bos_token_id
        assert http.post(route, json={}).status_code == 400
    ids = tok.encode("Hello")
    assert ids[0] == tok.bos_token_id
    for route in ("/detokenize", "/v1/detokenize"):
        assert http.post(route, json={"tokens": ids}).json() == {"text": "Hello"}
        assert http.post(route, json={"tokens": ids, "skip_special_tokens": False}).json() == {
            "text": tok.decode(ids, skip_special_tokens=False)
        }
        assert tok.bos_token in tok.decode(ids, skip_special_tokens=False)
        assert http.post(route, json={"tokens": [ids, ids[1:]]}).json() == {"text": ["Hello", "Hello"]}
        assert http.post(route, json={"tokens": []}).json() == {"text": ""}


def test_api_key_middleware(tokenizer):
    tm = FakeTM(tokenizer)
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {}

    add_openai_routes(app, tm, tm.server_args)
    add_api_key_middleware(app, "secret")
    http = TestClient(app)
    assert http.get("/health").status_code == 200
    r = http.get("/v1/models")
    assert r.status_code == 401 and r.json()["object"] == "error"
    assert http.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert http.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    for scheme in ("bearer", "BEARER"):  # the scheme is case-insensitive
        assert http.get("/v1/models", headers={"Authorization": f"{scheme} secret"}).status_code == 200
    for header in ("Basic secret", "secret", "Bearer", "Bearersecret"):
        assert http.get("/v1/models", headers={"Authorization": header}).status_code == 401, header
    with pytest.raises(openai.AuthenticationError):
        _client(app, api_key="wrong").models.list()
    assert _client(app, api_key="secret").models.list().data[0].id == MODEL


def test_load_chat_template(tmp_path):
    from tandem.entrypoints.openai.router import load_chat_template

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None
    with pytest.raises(ValueError, match="--chat-template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
