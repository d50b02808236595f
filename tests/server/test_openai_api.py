"""The OpenAI-compatible API of a real server, through the official `openai` client:
chat and completions (streamed and not) agree with the native /generate, usage counts
are exact, stop strings, n=2, logprobs, errors in OpenAI's shape, and --api-key."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_launcher import ServerHandle

MODEL = "tiny"
CONTEXT = 256
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]
PROMPT = "Once upon a time, there was a little boat"


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with ServerHandle(
        tiny_llama_dir, extra_args=["--served-model-name", MODEL, "--context-length", str(CONTEXT)]
    ) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def _generate(server, input_ids: list[int], max_new_tokens: int, **params) -> dict:
    r = httpx.post(
        server.base_url + "/generate",
        timeout=60,
        json={
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **params},
        },
    )
    r.raise_for_status()
    return r.json()


def _chat_ids(tokenizer) -> list[int]:
    """The prompt ids SGLang uses for MESSAGES: the template's, no BOS added by tokenizing."""
    return tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=False)


def test_chat_matches_generate(server, client, tokenizer):
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    ids = _chat_ids(tokenizer)
    native = _generate(server, ids, 12)
    (choice,) = resp.choices
    assert choice.message.role == "assistant" and choice.message.content == native["text"]
    assert choice.finish_reason == native["meta_info"]["finish_reason"]["type"]
    assert resp.object == "chat.completion" and resp.model == MODEL and resp.id.startswith("chatcmpl-")
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == native["meta_info"]["completion_tokens"]
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_stream_matches_non_stream(client):
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    full = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    body, usage = chunks[:-1], chunks[-1]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id and c.model == MODEL for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in body) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [full.choices[0].finish_reason]
    assert usage.choices == [] and usage.usage == full.usage


def test_chat_default_max_tokens_fills_context(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, extra_body={"ignore_eos": True}
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.total_tokens == CONTEXT


def test_completions_match_generate(server, client, tokenizer):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    ids = tokenizer.encode(PROMPT)
    native = _generate(server, ids, 10)
    assert resp.choices[0].text == native["text"] and resp.object == "text_completion"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 10
    # Token ids and a batch give the same text; each prompt is counted once.
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    assert by_ids.choices[0].text == native["text"]
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello"], max_tokens=10, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == native["text"]
    assert batch.usage.prompt_tokens == len(ids) + len(tokenizer.encode("Hello"))
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + native["text"]
    # Token ids are echoed as SGLang echoes them: decoded without special tokens (no BOS),
    # streamed or not (SGLang's test_completion checks text.startswith(prompt)).
    echo_text = tokenizer.decode(ids, skip_special_tokens=True)
    assert not echo_text.startswith(tokenizer.bos_token)
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, echo=True)
    assert echoed.choices[0].text == echo_text + native["text"]
    chunks = list(
        client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, echo=True, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == echo_text + native["text"]


def test_completions_stream(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_stop_string(client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


def test_n2(client):
    """n=2 is built: a refusal is a failure, not an expected one."""
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, n=2)
    single = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1]
    assert [c.message.content for c in resp.choices] == [single.choices[0].message.content] * 2
    assert resp.usage.prompt_tokens == single.usage.prompt_tokens
    assert resp.usage.completion_tokens == 2 * single.usage.completion_tokens
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, n=2, stream=True))
    assert sorted(c.choices[0].index for c in chunks if c.choices[0].finish_reason) == [0, 1]


def test_logprobs(client):
    resp = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    assert resp.choices[0].logprobs is not None, "logprobs=True gave no logprobs"
    content = resp.choices[0].logprobs.content
    assert content and len(content) == resp.usage.completion_tokens
    # Token texts are single-token decodes (SentencePiece drops a leading space there).
    assert "".join(t.token for t in content).replace(" ", "") == resp.choices[0].message.content.replace(" ", "")
    for t in content:
        assert len(t.top_logprobs) == 3 and t.logprob <= 0
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)  # greedy: the top token
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert lp is not None, "logprobs=2 gave no logprobs"
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert all(len(top) == 2 and x <= 0 for top, x in zip(lp.top_logprobs, lp.token_logprobs))


def test_models_and_tokenize(server, client, tokenizer):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    r = httpx.post(server.base_url + "/tokenize", json={"text": PROMPT}).json()
    assert r == {"tokens": tokenizer.encode(PROMPT), "count": len(tokenizer.encode(PROMPT)), "max_model_len": CONTEXT}
    r = httpx.post(server.base_url + "/detokenize", json={"tokens": tokenizer.encode(PROMPT)[1:]}).json()
    assert r["text"] == PROMPT


def test_tokenize_messages_gives_the_chat_prompt(server, client, tokenizer):
    """SGLang's /tokenize with `messages`: the ids the chat route feeds the model (its
    prompt_tokens), through the chat template; exactly one of prompt and messages."""
    ids = _chat_ids(tokenizer)
    for route in ("/tokenize", "/v1/tokenize"):
        r = httpx.post(server.base_url + route, json={"model": MODEL, "messages": MESSAGES})
        assert r.status_code == 200, r.text
        assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": CONTEXT}
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert chat.usage.prompt_tokens == len(ids)
    for body in ({"prompt": PROMPT, "messages": MESSAGES}, {}):
        r = httpx.post(server.base_url + "/tokenize", json=body)
        assert r.status_code == 400 and "Exactly one of 'prompt' or 'messages' must be provided" in r.text, r.text
    bad = httpx.post(server.base_url + "/tokenize", json={"messages": [{"role": "wizard", "content": "Hi"}]})
    assert bad.status_code == 400, bad.text


@pytest.mark.parametrize(
    "kwargs,param,text",
    [
        ({"temperature": -1}, "temperature", "temperature"),
        ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages.0.role", "'role' must be one of"),
        ({"frequency_penalty": 3.0}, "frequency_penalty", "frequency_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias", "logit_bias"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens", "min_tokens"),
        ({"extra_body": {"stop_regex": "(and|or"}}, "stop_regex", "stop_regex: invalid regex"),
        # SGLang's wording, which clients and SGLang's tests match on.
        ({"max_tokens": 1000}, "max_tokens", "max_completion_tokens is too large: 1000"),
        ({"max_tokens": CONTEXT - 1}, "max_tokens", "Requested token count exceeds the model's maximum context length"),
        (
            {"messages": [{"role": "user", "content": "sea " * 300}]},
            "messages",
            "is longer than the model's context length",
        ),
        ({"top_logprobs": 3}, "top_logprobs", "top_logprobs"),
    ],
)
def test_bad_requests_are_400(client, kwargs, param, text):
    args = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**args)
    body = e.value.response.json()
    assert body["object"] == "error" and body["param"] == param and text in body["message"]
    assert body["type"] == "BadRequestError" and body["code"] == 400


def test_any_model_name_is_served(client):
    out = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=2)
    assert out.model == "default" and out.choices[0].finish_reason == "length"


def test_errors_and_still_serving(server, client):
    r = httpx.get(server.base_url + "/v1/no-such-route")
    assert r.status_code == 404 and r.json()["object"] == "error"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": "two"})
    assert r.status_code == 400 and r.json()["param"] == "n"
    r = httpx.post(server.base_url + "/v1/completions", json={"model": MODEL, "prompt": [1, 10**6]})
    assert r.status_code == 400 and r.json()["param"] == "prompt"
    r = httpx.post(server.base_url + "/v1/chat/completions", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, temperature=0)
    assert resp.usage.completion_tokens == 4


def test_api_key_and_skip_tokenizer_init(tiny_llama_dir):
    """A second server, with --api-key and without a tokenizer: 401 without the key,
    400 for text prompts, token-id prompts work."""
    with ServerHandle(
        tiny_llama_dir,
        extra_args=[
            "--served-model-name",
            MODEL,
            "--api-key",
            "sekret",
            "--skip-tokenizer-init",
            "--skip-server-warmup",
        ],
    ) as srv:
        assert httpx.get(srv.base_url + "/health").status_code == 200
        r = httpx.get(srv.base_url + "/v1/models")
        assert r.status_code == 401 and r.json()["object"] == "error"
        assert httpx.post(srv.base_url + "/generate", json={"input_ids": [1, 2]}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="sekret", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
            good.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3)
        with pytest.raises(openai.BadRequestError, match="without a tokenizer"):
            good.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
        resp = good.completions.create(model=MODEL, prompt=[1, 600, 922], max_tokens=3, temperature=0)
        assert resp.usage.prompt_tokens == 3 and resp.usage.completion_tokens == 3
        assert resp.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "route,body",
    [
        ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}),
        ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}),
    ],
)
def test_model_is_optional_and_means_the_served_model(server, route, body):
    """As in SGLang, a request without `model` is served by the served model, and says so."""
    r = httpx.post(server.base_url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL and r.json()["usage"]["completion_tokens"] == 3
