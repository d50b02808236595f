"""Greedy fp32 outputs of the running server equal Hugging Face transformers' `generate`,
for prompts of different lengths sent concurrently."""

from __future__ import annotations

import asyncio

import hf_reference
import httpx
import pytest
from server_launcher import ServerHandle

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read books about the sea.",
    "1 2 3 4 5",
    "A",
    "Tell me a story about a cat and a boat, please, with many details about the weather and the food.",
]
MAX_NEW_TOKENS = 32


async def _generate_all(base_url: str, prompts: list[str]) -> list[dict]:
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

        async def one(p: str) -> dict:
            r = await client.post(
                "/generate", json={"text": p, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
            )
            r.raise_for_status()
            return r.json()

        return await asyncio.gather(*[one(p) for p in prompts])


@pytest.mark.parametrize(
    "model_fixture,linear_backend",
    [
        ("tiny_llama_dir", "auto"),
        ("tiny_qwen2_dir", "auto"),
        ("stories_dir", "auto"),
        # F.linear on the weights as loaded, untied and tied LM heads.
        ("tiny_llama_dir", "torch"),
        ("tiny_qwen2_dir", "torch"),
    ],
)
def test_greedy_matches_transformers(model_fixture, linear_backend, request):
    model_dir = request.getfixturevalue(model_fixture)
    expected = [hf_reference.greedy_ids(model_dir, hf_reference.encode(model_dir, p), MAX_NEW_TOKENS) for p in PROMPTS]
    with ServerHandle(model_dir, extra_args=["--linear-backend", linear_backend]) as server:
        outputs = asyncio.run(_generate_all(server.base_url, PROMPTS))
    for prompt, out, ref in zip(PROMPTS, outputs, expected):
        assert out["output_ids"] == ref, f"prompt {prompt!r}"
        assert out["meta_info"]["prompt_tokens"] == len(hf_reference.encode(model_dir, prompt))
        assert out["meta_info"]["completion_tokens"] == len(ref)
        # The text is what the output ids add to the prompt's text (SGLang's rule).
        tok, _ = hf_reference.load(str(model_dir))
        ids = hf_reference.encode(model_dir, prompt)
        prompt_text = tok.decode(ids, skip_special_tokens=True)
        assert prompt_text + out["text"] == tok.decode(ids + ref, skip_special_tokens=True)


def test_stories_greedy_text_is_english(stories_dir):
    with ServerHandle(stories_dir) as server:
        r = httpx.post(
            server.base_url + "/generate",
            timeout=60,
            json={"text": "Once upon a time", "sampling_params": {"max_new_tokens": 60, "temperature": 0}},
        )
    text = r.json()["text"]
    words = set(text.lower().replace(".", " ").replace(",", " ").split())
    assert {"the", "was", "a"} & words, text
    assert "\ufffd" not in text
