"""Penalties and min_new_tokens through a running server: greedy fp32 outputs equal
transformers' `generate` with the same adjustments, for requests with different
penalties (and none) decoded in one batch; the OpenAI routes pass them through."""

from __future__ import annotations

import asyncio

import hf_reference
import httpx
import openai
import torch
from transformers import LogitsProcessor, LogitsProcessorList

MAX_NEW = 24
PROMPT = "The cat sat on the mat and the cat"


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's frequency/presence formula over the generated tokens (the reference)."""

    def __init__(self, prompt_len: int, frequency: float, presence: float):
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        generated = input_ids[0, self.prompt_len :].tolist()
        for token in set(generated):
            scores[0, token] -= self.frequency * generated.count(token) + self.presence
        return scores


def _generate_all(base_url: str, param_sets: list[dict]) -> list[dict]:
    async def run() -> list[dict]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:

            async def one(params: dict) -> dict:
                r = await client.post(
                    "/generate",
                    json={"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": MAX_NEW, **params}},
                )
                r.raise_for_status()
                return r.json()

            return await asyncio.gather(*[one(p) for p in param_sets])

    return asyncio.run(run())


def test_penalties_match_transformers(server, tiny_llama_dir):
    ids = hf_reference.encode(tiny_llama_dir, PROMPT)
    cases = [
        ({}, {}),
        ({"repetition_penalty": 1.5}, {"repetition_penalty": 1.5}),
        ({"repetition_penalty": 0.8}, {"repetition_penalty": 0.8}),
        ({"frequency_penalty": 1.0}, {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids), 1.0, 0.0)])}),
        (
            {"presence_penalty": 1.5, "frequency_penalty": -0.5},
            {"logits_processor": LogitsProcessorList([OpenAIPenalties(len(ids), -0.5, 1.5)])},
        ),
    ]
    outs = _generate_all(server.base_url, [params for params, _ in cases])
    plain = outs[0]["output_ids"]
    assert plain == hf_reference.greedy_ids(tiny_llama_dir, ids, MAX_NEW)
    for (params, hf_kwargs), out in zip(cases[1:], outs[1:]):
        expected = hf_reference.greedy_ids(tiny_llama_dir, ids, MAX_NEW, **hf_kwargs)
        assert out["output_ids"] == expected, params
    # The penalties changed something (else the comparison above proves little).
    assert any(out["output_ids"] != plain for out in outs[1:])


def test_min_new_tokens_holds_back_stop_tokens(server):
    first = _generate_all(server.base_url, [{"max_new_tokens": 1}])[0]["output_ids"][0]
    stopped, held = _generate_all(
        server.base_url,
        [{"stop_token_ids": [first]}, {"stop_token_ids": [first], "min_new_tokens": 6, "max_new_tokens": 8}],
    )
    assert stopped["output_ids"] == [first] and stopped["meta_info"]["finish_reason"]["matched"] == first
    assert len(held["output_ids"]) >= 6 and first not in held["output_ids"][:6]


def test_openai_penalties_pass_through(server, tiny_llama_dir):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    model = str(tiny_llama_dir)
    ids = hf_reference.encode(tiny_llama_dir, PROMPT)
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_NEW,
        temperature=0,
        frequency_penalty=1.0,
        extra_body={"repetition_penalty": 1.5},
    )
    native = _generate_all(server.base_url, [{"frequency_penalty": 1.0, "repetition_penalty": 1.5}])[0]
    assert out.choices[0].text == native["text"]
    assert out.usage.prompt_tokens == len(ids)
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=8,
        temperature=0,
        presence_penalty=2.0,
        extra_body={"min_tokens": 8},
    )
    assert chat.usage.completion_tokens == 8 and chat.choices[0].finish_reason == "length"
