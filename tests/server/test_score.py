"""POST /v1/score (SGLang's decoder-only scoring), checked against transformers on the
same weights: the probability of each label token right after query + item."""

from __future__ import annotations

import math

import hf_reference
import pytest
import torch

LABELS = [5, 17, 300]


def _reference(model_dir, ids: list[int]) -> list[float]:
    """Label logprobs at the position after `ids`."""
    _, model = hf_reference.load(str(model_dir))
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)[LABELS].tolist()


def test_score_text_items_match_transformers(client, tiny_llama_dir):
    body = {
        "query": "Once upon a time,",
        "items": [" there was", " a cat"],
        "label_token_ids": LABELS,
        "return_token_logprobs": True,
        "model": "default",
    }
    r = client.post("/v1/score", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "scoring" and out["model"] == "default" and out["pooled_hidden_states"] is None
    prompt_tokens = 0
    for i, item in enumerate(body["items"]):
        ids = hf_reference.encode(tiny_llama_dir, body["query"] + item)
        prompt_tokens += len(ids)
        ref = _reference(tiny_llama_dir, ids)
        assert out["token_logprobs"][i] == pytest.approx(ref, abs=1e-4)
        assert out["scores"][i] == pytest.approx([math.exp(x) for x in ref], rel=1e-4)
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] == prompt_tokens
    assert out["usage"]["completion_tokens"] == 0


def test_score_token_ids_softmax_item_first_and_per_item_labels(client, tiny_llama_dir):
    query, items = [1, 40, 41], [[50, 51], [60]]
    r = client.post(
        "/v1/score",
        json={
            "query": query,
            "items": items,
            "label_token_ids": LABELS,
            "apply_softmax": True,
            "temperature": 0.5,
            "item_first": True,
        },
    )
    assert r.status_code == 200, r.text
    for scores, item in zip(r.json()["scores"], items):
        ref = torch.tensor(_reference(tiny_llama_dir, item + query))
        assert scores == pytest.approx(torch.softmax(ref / 0.5, dim=-1).tolist(), abs=1e-5)
        assert sum(scores) == pytest.approx(1.0)
    r = client.post("/v1/score", json={"query": query, "items": items, "label_token_ids": [[5], [17, 300]]})
    assert [len(s) for s in r.json()["scores"]] == [1, 2]
    assert r.json()["token_logprobs"] is None
    r = client.post("/v1/score", json={"query": "x", "items": [], "label_token_ids": LABELS})
    assert r.status_code == 200 and r.json()["scores"] == []


@pytest.mark.parametrize(
    "body, message",
    [
        ({"query": "a", "items": ["b"]}, "label_token_ids is required for generation (CausalLM) models."),
        ({"query": "a", "label_token_ids": [1]}, "items must be provided"),
        ({"query": "a", "items": ["b"], "label_token_ids": [1, 1]}, "label_token_ids must not contain duplicate"),
        ({"query": "a", "items": ["b"], "label_token_ids": [-1]}, "label_token_ids must contain nonnegative"),
        ({"query": "a", "items": ["b"], "label_token_ids": [10**6]}, "Token ID 1000000 is out of vocabulary"),
        ({"query": "a", "items": ["b", "c"], "label_token_ids": [[1]]}, "label_token_ids must have one list per item"),
        (
            {"query": "a", "items": ["b"], "label_token_ids": [1], "temperature": 2.0},
            "temperature requires apply_softmax=True",
        ),
        ({"query": [1], "items": ["b"], "label_token_ids": [1]}, "Invalid combination of query/items types"),
        (
            {"query": "a", "items": ["b"], "label_token_ids": [1], "score_extraction_token": "<s>"},
            "score_extraction_token: not supported yet",
        ),
        (
            {"query": "a", "items": ["b"], "label_token_ids": [1], "return_pooled_hidden_states": True},
            "return_pooled_hidden_states is not supported for CausalLM models",
        ),
    ],
)
def test_score_refusals_use_sglang_messages(client, body, message):
    r = client.post("/v1/score", json=body)
    assert r.status_code == 400 and r.json()["message"].startswith(message), r.text
    assert r.json()["code"] == 400
