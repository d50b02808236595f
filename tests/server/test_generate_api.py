"""The native /generate API of a running server: streaming, stop conditions, batches,
concurrency, bad input, and the info routes."""

from __future__ import annotations

import asyncio
import json

import hf_reference
import httpx
import pytest
from http_helpers import generate, stream_events
from server_launcher import ServerHandle

GREEDY = {"temperature": 0}
# Long enough that some chunk reaches the client before the request finishes even when
# the scheduler starves the main process on a loaded 2-core machine (chunks that pile up
# are coalesced into one, by design, so a short stream may arrive as a single chunk).
LONG_STREAM = {**GREEDY, "max_new_tokens": 300, "ignore_eos": True}


def stream_chunks(client, **body) -> list[dict]:
    return stream_events(client, "/generate", {**body, "stream": True})


def test_stream_equals_non_stream(client):
    params = LONG_STREAM
    full = generate(client, text="The weather today is", sampling_params=params)
    chunks = stream_chunks(client, text="The weather today is", sampling_params=params)
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["output_ids"] == full["output_ids"]
    # Each chunk's text extends the previous one.
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"])
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_unicode_prompt_round_trips_without_replacement_chars(client, tiny_llama_dir):
    text = "日本語のテキスト 😀 café"
    out = generate(client, text=text, sampling_params={**GREEDY, "max_new_tokens": 30})
    tok, _ = hf_reference.load(str(tiny_llama_dir))

    def after_prompt(prompt_ids: list[int], output_ids: list[int]) -> str:
        """The output's text as it reads after the prompt's (what the server sends)."""
        head = tok.decode(prompt_ids, skip_special_tokens=True)
        return tok.decode(prompt_ids + output_ids, skip_special_tokens=True)[len(head) :]

    expected = after_prompt(tok.encode(text), out["output_ids"])
    assert out["text"] == expected
    if "\ufffd" not in expected:
        assert "\ufffd" not in out["text"]
    # Generating from byte tokens of an emoji: the text is their decode, never broken.
    emoji_ids = tok.encode("😀😀", add_special_tokens=False)
    out = generate(client, input_ids=emoji_ids, sampling_params={**GREEDY, "max_new_tokens": 8})
    assert out["text"] == after_prompt(emoji_ids, out["output_ids"])


def test_stop_string_spanning_tokens_is_trimmed(client, tiny_llama_dir):
    params = {**GREEDY, "max_new_tokens": 40, "ignore_eos": True}
    full = generate(client, text="Once upon a time", sampling_params=params)
    tok, _ = hf_reference.load(str(tiny_llama_dir))
    # A stop string made of the end of token 5 and the start of token 6's text.
    pieces = [tok.decode(full["output_ids"][:i], skip_special_tokens=True) for i in range(1, 12)]
    cut = len(pieces[4])
    stop = pieces[6][cut - 2 : cut + 2] if len(pieces[6]) >= cut + 2 else pieces[6][-4:]
    assert len(stop) >= 2 and stop in full["text"]
    out = generate(client, text="Once upon a time", sampling_params={**params, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == full["text"][: full["text"].index(stop)]
    # no_stop_trim keeps it; streaming ends on the same trimmed text.
    kept = generate(client, text="Once upon a time", sampling_params={**params, "stop": stop, "no_stop_trim": True})
    assert kept["text"].startswith(out["text"] + stop)
    chunks = stream_chunks(client, text="Once upon a time", sampling_params={**params, "stop": [stop]})
    assert chunks[-1]["text"] == out["text"]
    assert all(stop not in c["text"] for c in chunks)


def test_max_new_tokens_and_ignore_eos(client):
    out = generate(client, text="Hi", sampling_params={**GREEDY, "max_new_tokens": 7, "ignore_eos": True})
    assert len(out["output_ids"]) == 7
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert out["meta_info"]["completion_tokens"] == 7


def test_stop_token_ids(client):
    base = generate(client, text="Count:", sampling_params={**GREEDY, "max_new_tokens": 10, "ignore_eos": True})
    target = base["output_ids"][3]
    first = base["output_ids"].index(target)
    out = generate(client, text="Count:", sampling_params={**GREEDY, "max_new_tokens": 10, "stop_token_ids": [target]})
    assert out["output_ids"] == base["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": target}


def test_batch_and_input_ids(client, tiny_llama_dir):
    prompts = ["alpha", "beta gamma", "delta epsilon zeta"]
    batch = generate(client, text=prompts, sampling_params={**GREEDY, "max_new_tokens": 12})
    assert isinstance(batch, list) and len(batch) == 3
    for p, out in zip(prompts, batch):
        single = generate(
            client, input_ids=hf_reference.encode(tiny_llama_dir, p), sampling_params={**GREEDY, "max_new_tokens": 12}
        )
        assert out["output_ids"] == single["output_ids"]


def test_sampling_seed_is_reproducible_across_batches(client):
    params = {"temperature": 1.0, "top_p": 0.9, "max_new_tokens": 16, "sampling_seed": 1234, "ignore_eos": True}
    alone = generate(client, text="Seeded sampling", sampling_params=params)
    batch = generate(
        client,
        text=["Seeded sampling", "something else", "and more"],
        sampling_params=[params, {"temperature": 1.0, "max_new_tokens": 16}, {"max_new_tokens": 5}],
    )
    assert batch[0]["output_ids"] == alone["output_ids"]
    other_seed = generate(client, text="Seeded sampling", sampling_params={**params, "sampling_seed": 99})
    assert other_seed["output_ids"] != alone["output_ids"]


def test_64_concurrent_requests(server, client):
    prompts = [f"Request number {i} says" + " word" * (i % 9) for i in range(64)]
    params = {**GREEDY, "max_new_tokens": 16}
    expected = [generate(client, text=p, sampling_params=params)["output_ids"] for p in prompts[:8]]

    async def run() -> list[dict]:
        async with httpx.AsyncClient(
            base_url=server.base_url, timeout=300, limits=httpx.Limits(max_connections=100)
        ) as ac:

            async def one(i: int, p: str) -> dict:
                if i % 2:
                    last = None
                    async with ac.stream(
                        "POST", "/generate", json={"text": p, "sampling_params": params, "stream": True}
                    ) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                last = json.loads(line[6:])
                    return last
                r = await ac.post("/generate", json={"text": p, "sampling_params": params})
                return r.json()

            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    results = asyncio.run(run())
    assert len(results) == 64
    for i, out in enumerate(results):
        assert out["meta_info"]["finish_reason"] is not None
        assert 1 <= len(out["output_ids"]) <= 16
        if i < 8:
            assert out["output_ids"] == expected[i]


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "x", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "x", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"text": "x", "sampling_params": {"max_new_tokens": "ten"}}, "max_new_tokens"),
        ({"text": "x", "sampling_params": {"bogus": 1}}, "bogus"),
        ({"text": "x", "input_ids": [1, 2]}, "input_ids"),
        ({"input_ids": [10**9]}, "input_ids"),
        ({"text": 5}, "text"),
        ({"text": "x", "stream": "yes"}, "stream"),
        ({"text": "word " * 5000}, "context length"),
        # SGLang's wording, which its clients match on (the tiny model's context is 2048).
        ({"input_ids": [5] * 2048}, "The input (2048 tokens) is longer than the model's context length (2048 tokens)."),
    ],
)
def test_bad_input_gets_400_naming_the_field(client, body, field):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]
    assert generate(client, text="still alive", sampling_params={"max_new_tokens": 2})["output_ids"]


def test_invalid_json_is_400(client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


def test_info_routes(client, tiny_llama_dir):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200
    info = client.get("/model_info").json()
    assert info["model_path"] == str(tiny_llama_dir) and info["is_generation"] is True
    server_info = client.get("/server_info").json()
    assert server_info["max_total_num_tokens"] > 0
    assert server_info["context_length"] == 2048
    assert server_info["model_path"] == str(tiny_llama_dir)


def test_incremental_streaming_output_deltas_join_to_the_text(client, tiny_llama_dir):
    params = {**GREEDY, "max_new_tokens": 40, "stop": ["e t"]}
    full = generate(client, text="Deltas join", sampling_params=params)
    with ServerHandle(tiny_llama_dir, extra_args=["--incremental-streaming-output", "--skip-server-warmup"]) as s:
        with httpx.Client(base_url=s.base_url, timeout=60) as inc:
            chunks = stream_chunks(inc, text="Deltas join", sampling_params=params)
            long_full = generate(inc, text="Deltas join", sampling_params=LONG_STREAM)
            long_chunks = stream_chunks(inc, text="Deltas join", sampling_params=LONG_STREAM)
    assert "".join(c["text"] for c in chunks) == full["text"]
    assert [t for c in chunks for t in c["output_ids"]] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    # Deltas, not the text so far: several chunks whose ids add up to the whole output once.
    assert len(long_chunks) > 1
    assert [t for c in long_chunks for t in c["output_ids"]] == long_full["output_ids"]
    assert "".join(c["text"] for c in long_chunks) == long_full["text"]
