"""The request boundary without a server: JSON body parsing (strict, depth-limited, lone
surrogates named by field), the body size middleware, the characters-per-token bound
that refuses too-long prompts before tokenizing, and the tokenizer thread."""

from __future__ import annotations

import asyncio
import json
import math

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.responses import JSONResponse, Response
from transformers import AutoTokenizer

from tandem.entrypoints.json_body import InvalidBody, parse_json_body
from tandem.entrypoints.limits import BodySizeLimit
from tandem.tokenizer.text_encoder import TextEncoder
from tandem.utils.tokenizer import max_chars_per_token

# ---- JSON bodies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"NaN",
        b'{"t": Infinity}',
        b'{"t": -Infinity}',
        b'{"t": 1e400}',
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a": ' * 2000 + b"1" + b"}" * 2000,
        b'{"t": "\xff"}',
    ],
)
def test_invalid_json_bodies(body):
    with pytest.raises(InvalidBody) as e:
        parse_json_body(body)
    assert e.value.message.startswith("request body: invalid JSON (") and e.value.field is None


def test_numbers_past_64_bits_parse():
    assert parse_json_body(b'{"k": 18446744073709551615}') == {"k": 2**64 - 1}
    assert parse_json_body(b'{"k": 18446744073709551616}') == {"k": float(2**64)}


@pytest.mark.parametrize(
    "body, field",
    [
        ('{"text": "a\\ud800"}', "text"),
        ('{"sampling_params": {"stop": ["ok", "\\udc00"]}}', "sampling_params.stop.1"),
        ('{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
        ('["\\ud800"]', "0"),
        ('"\\ud800"', "request body"),
        ('{"a": {"\\ud800": 1}}', "a (a key)"),
    ],
)
def test_lone_surrogate_names_the_field(body, field):
    with pytest.raises(InvalidBody) as e:
        parse_json_body(body.encode())
    assert e.value.message.startswith(f"{field}: contains a lone surrogate")
    assert parse_json_body(b'{"text": "\\ud83d\\ude00"}') == {"text": "\U0001f600"}


# ---- body size --------------------------------------------------------------------------


@pytest.fixture
def limited_app():
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> Response:
        return JSONResponse({"size": len(await request.body())})

    def error(path: str, message: str, status: int) -> Response:
        return JSONResponse({"path": path, "message": message}, status_code=status)

    app.add_middleware(BodySizeLimit, max_bytes=1000, error=error)
    return app


def test_body_size_limit(limited_app):
    with TestClient(limited_app) as c:
        assert c.post("/echo", content=b"x" * 1000).json() == {"size": 1000}
        r = c.post("/echo", content=b"x" * 1001)
        assert (
            r.status_code == 413
            and r.json()["path"] == "/echo"
            and r.json()["message"].startswith("request body: 1001 bytes, larger than")
        )
        assert "--max-request-body-bytes" in r.json()["message"]

        def chunks():  # no Content-Length: chunked
            for _ in range(5):
                yield b"x" * 300

        r = c.post("/echo", content=chunks())
        assert r.status_code == 413 and r.json()["message"].startswith("request body: larger than the limit of 1000")
        assert c.post("/echo", content=(b"x" * 300 for _ in range(3))).json() == {"size": 900}


# ---- characters per token -----------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(tiny_llama_dir, tiny_qwen2_dir):
    return {
        "llama": AutoTokenizer.from_pretrained(tiny_llama_dir),
        "qwen2": AutoTokenizer.from_pretrained(tiny_qwen2_dir),
    }


def test_bound_of_the_tiny_tokenizers(tokenizers):
    # The longest entries are the chat markers (12 characters); Qwen2's NFC may merge 4 into 1.
    assert max_chars_per_token(tokenizers["llama"]) == 12
    assert max_chars_per_token(tokenizers["qwen2"]) == 48


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(max_size=200)
    | st.sampled_from(["<|im_start|>" * 20, "a" * 500, "e\u0301" * 50, "\u1100\u1161\u11a8" * 30, " " * 300])
)
def test_no_text_has_fewer_tokens_than_the_bound_says(tokenizers, text):
    for tok in tokenizers.values():
        bound = max_chars_per_token(tok)
        assert len(tok.encode(text, add_special_tokens=False)) >= math.ceil(len(text) / bound)


@pytest.mark.parametrize(
    "normalizer, pre_tokenizer, model, bound",
    [
        (None, None, {"type": "BPE", "byte_fallback": True}, 1),
        (
            {"type": "Replace", "pattern": {"String": "  "}, "content": " "},
            None,
            {"type": "BPE", "byte_fallback": True},
            2,
        ),
        (
            {"type": "Replace", "pattern": {"String": " "}, "content": ""},
            None,
            {"type": "BPE", "byte_fallback": True},
            None,
        ),
        ({"type": "Strip"}, None, {"type": "BPE", "byte_fallback": True}, None),
        (
            {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
            None,
            {"type": "BPE", "unk_token": "<unk>"},
            4,
        ),
        (None, {"type": "Whitespace"}, {"type": "BPE", "byte_fallback": True}, None),
        (None, {"type": "Split", "behavior": "Removed"}, {"type": "BPE", "byte_fallback": True}, None),
        (None, None, {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True}, None),
        (None, None, {"type": "BPE"}, None),
        (None, {"type": "ByteLevel"}, {"type": "BPE"}, 1),
        (None, None, {"type": "WordPiece", "unk_token": "[UNK]"}, None),
        (None, None, {"type": "Unigram", "byte_fallback": True}, 1),
    ],
)
def test_bound_needs_a_tokenizer_that_keeps_every_character(normalizer, pre_tokenizer, model, bound):
    class Backend:
        def to_str(self) -> str:
            return json.dumps({"normalizer": normalizer, "pre_tokenizer": pre_tokenizer, "model": model})

    class Tok:
        backend_tokenizer = Backend()

        def get_vocab(self) -> dict:
            return {"a": 0, "bc": 1}

    expected = None if bound is None else 2 * bound
    assert max_chars_per_token(Tok()) == expected


# ---- the tokenizer thread -----------------------------------------------------------------


def test_text_encoder(tokenizers):
    tok = tokenizers["llama"]
    encoder = TextEncoder(tok)
    try:
        assert asyncio.run(encoder.encode("Hello world", "text")) == tok.encode("Hello world")
        assert asyncio.run(encoder.decode(tok.encode("Hello"), skip_special_tokens=True)) == "Hello"
        fits = "a" * 120  # 10 tokens x 12 characters: may fit, so it is tokenized
        assert asyncio.run(encoder.encode(fits, "prompt", max_tokens=10)) == tok.encode(fits)
        with pytest.raises(ValueError, match=r"^prompt: the prompt is 121 characters long"):
            asyncio.run(encoder.encode("a" * 121, "prompt", max_tokens=10))
        with pytest.raises(ValueError, match=r"^messages: contains a lone surrogate '\\ud800' at character 2"):
            asyncio.run(encoder.encode("ab\ud800", "messages"))
    finally:
        encoder.close()
