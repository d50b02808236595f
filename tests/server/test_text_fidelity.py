"""Text fidelity on stories260K (SentencePiece with byte fallback): the prompt's text
followed by the output's text is the text of prompt + output ids, as in SGLang, on
/generate (not streamed, streamed cumulatively and incrementally) and /v1/completions,
with stop strings and no_stop_trim too. ("Tom had a" then " big box", not "big box".)

One module-scoped server per streaming mode: the default (cumulative /generate streams)
and --incremental-streaming-output.
"""

from __future__ import annotations

import httpx
import pytest
from http_helpers import generate, stream_events
from server_launcher import ServerHandle
from transformers import AutoTokenizer

PROMPTS = ["Tom had a", "Once upon a time", "Lily saw a 猫 and"]  # 猫: byte-fallback tokens
GREEDY = {"temperature": 0, "max_new_tokens": 24}


@pytest.fixture(scope="module")
def tokenizer(stories_dir):
    return AutoTokenizer.from_pretrained(stories_dir)


@pytest.fixture(scope="module", params=["cumulative", "incremental"])
def mode(request, stories_dir):
    """(client, whether /generate streams only what is new)."""
    incremental = request.param == "incremental"
    args = ["--incremental-streaming-output"] if incremental else []
    with ServerHandle(stories_dir, args) as server, httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client, incremental


def _streamed(client, incremental: bool, body: dict) -> dict:
    """The final text and ids of a streamed /generate, checking that the chunks add up."""
    chunks = stream_events(client, "/generate", {**body, "stream": True})
    if incremental:
        return {
            "text": "".join(c["text"] for c in chunks),
            "output_ids": [i for c in chunks for i in c["output_ids"]],
            "meta_info": chunks[-1]["meta_info"],
        }
    for before, after in zip(chunks, chunks[1:]):
        assert after["text"].startswith(before["text"])
    return chunks[-1]


def _outputs(client, incremental: bool, prompt: str, params: dict) -> list[dict]:
    body = {"text": prompt, "sampling_params": params}
    return [generate(client, **body), _streamed(client, incremental, body)]


def _text_after_prompt(tokenizer, prompt_ids: list[int], output_ids: list[int]) -> str:
    head = tokenizer.decode(prompt_ids, skip_special_tokens=True)
    full = tokenizer.decode(prompt_ids + output_ids, skip_special_tokens=True)
    assert full.startswith(head)
    return full[len(head) :]


def test_generate_prompt_then_output_is_decode_of_all_ids(mode, tokenizer):
    client, incremental = mode
    for prompt in PROMPTS:
        prompt_ids = tokenizer.encode(prompt)
        plain, streamed = _outputs(client, incremental, prompt, GREEDY)
        assert streamed["output_ids"] == plain["output_ids"] and streamed["text"] == plain["text"]
        assert plain["text"] == _text_after_prompt(tokenizer, prompt_ids, plain["output_ids"])
        if prompt == "Tom had a":
            assert plain["text"].startswith(" "), plain["text"]  # " big box", not "big box"


def test_generate_stop_strings_and_no_stop_trim(mode, tokenizer):
    client, incremental = mode
    prompt = "Tom had a"
    prompt_ids = tokenizer.encode(prompt)
    text = generate(client, text=prompt, sampling_params=GREEDY)["text"]
    first, second = [" " + w for w in text.split()[:2]]  # " big", " box" ...
    for stop, expected in ((first, ""), (second, text[: text.index(second)])):
        for out in _outputs(client, incremental, prompt, {**GREEDY, "stop": [stop]}):
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert out["text"] == expected
        for out in _outputs(client, incremental, prompt, {**GREEDY, "stop": [stop], "no_stop_trim": True}):
            assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
            assert out["text"] == _text_after_prompt(tokenizer, prompt_ids, out["output_ids"])
            assert out["text"].startswith(expected + stop)


def test_completions_text_matches(mode, tokenizer):
    client, _ = mode
    for prompt in PROMPTS:
        native = generate(client, text=prompt, sampling_params=GREEDY)
        body = {"model": "default", "prompt": prompt, "max_tokens": GREEDY["max_new_tokens"], "temperature": 0}
        full = client.post("/v1/completions", json=body)
        assert full.status_code == 200, full.text
        assert full.json()["choices"][0]["text"] == native["text"]
        chunks = stream_events(client, "/v1/completions", {**body, "stream": True})
        assert "".join(c["choices"][0]["text"] for c in chunks) == native["text"]
        echoed = client.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]["text"]
        assert echoed == prompt + native["text"]
