"""`token_ids_logprob` (SGLang's GenerateReqInput field): the logprobs of chosen token ids
at every output position (`meta_info.output_token_ids_logprobs`) and, from
`logprob_start_len`, every prompt position (`input_token_ids_logprobs`), checked against
the full distribution (`top_logprobs_num` = the vocabulary) and against transformers."""

from __future__ import annotations

import json
import math

import hf_reference
import pytest
import torch

PROBES = [0, 1, 7, 300, 7]  # duplicates are kept, in order, as in SGLang


def _vocab(client) -> int:
    return client.get("/server_info").json()["vocab_size"]


def _by_id(top: list) -> dict[int, float]:
    return {tid: lp for lp, tid, _ in top}


def test_token_ids_logprob_equals_full_distribution(client):
    vocab = _vocab(client)
    body = {
        "text": "Once upon a time",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": vocab,
        "token_ids_logprob": PROBES,
        "return_text_in_logprobs": True,
    }
    meta = client.post("/generate", json=body).json()["meta_info"]
    outs, out_tops = meta["output_token_ids_logprobs"], meta["output_top_logprobs"]
    assert len(outs) == meta["completion_tokens"] == 4
    for entries, top in zip(outs, out_tops):
        assert [e[1] for e in entries] == PROBES
        full = _by_id(top)
        for lp, tid, text in entries:
            assert lp == pytest.approx(full[tid], abs=1e-5) and isinstance(text, str)
    ins, in_tops = meta["input_token_ids_logprobs"], meta["input_top_logprobs"]
    assert len(ins) == meta["prompt_tokens"] and ins[0] is None  # the first prompt token has no score
    for entries, top in zip(ins[1:], in_tops[1:]):
        full = _by_id(top)
        assert [e[1] for e in entries] == PROBES
        assert all(lp == pytest.approx(full[tid], abs=1e-5) for lp, tid, _ in entries)


def test_token_ids_logprob_matches_transformers(client, tiny_llama_dir):
    _, model = hf_reference.load(str(tiny_llama_dir))
    prompt = [1, 50, 60, 70, 80]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True,
        "logprob_start_len": 2,
        "token_ids_logprob": PROBES,
    }
    out = client.post("/generate", json=body).json()
    meta = out["meta_info"]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out["output_ids"]])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)[:, PROBES]
    # Prompt token j (from logprob_start_len on) is scored at position j - 1; output k at len(prompt) - 1 + k.
    got_in = torch.tensor([[e[0] for e in row] for row in meta["input_token_ids_logprobs"]])
    torch.testing.assert_close(got_in, ref[1 : len(prompt) - 1], atol=1e-4, rtol=0)
    got_out = torch.tensor([[e[0] for e in row] for row in meta["output_token_ids_logprobs"]])
    torch.testing.assert_close(got_out, ref[len(prompt) - 1 : len(prompt) + 2], atol=1e-4, rtol=0)
    assert all(e[2] is None for row in meta["output_token_ids_logprobs"] for e in row)


def test_token_ids_logprob_prefill_only_batch_and_stream(client):
    # max_new_tokens 0 (how /v1/score asks): one position, the one after the prompt, no token.
    body = {
        "text": ["One day", "The cat"],
        "sampling_params": {"max_new_tokens": 0},
        "return_logprob": True,
        "token_ids_logprob": [[3, 4], [5]],
    }
    outs = client.post("/generate", json=body).json()
    assert [[e[1] for e in o["meta_info"]["output_token_ids_logprobs"][0]] for o in outs] == [[3, 4], [5]]
    for o in outs:
        assert o["output_ids"] == [] and o["meta_info"]["output_token_logprobs"] == []
        assert o["meta_info"]["input_token_ids_logprobs"] == []
        assert all(math.isfinite(e[0]) and e[0] < 0 for e in o["meta_info"]["output_token_ids_logprobs"][0])
    # Streamed chunks carry the entries of their own tokens; together, one per token.
    body = {
        "text": "One day",
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "token_ids_logprob": [2],
        "stream": True,
    }
    with client.stream("POST", "/generate", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert len(chunks[-1]["meta_info"]["output_token_ids_logprobs"]) == 5


def test_token_ids_logprob_absent_or_refused(client):
    meta = client.post(
        "/generate",
        json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "token_ids_logprob": []},
    ).json()["meta_info"]
    assert "output_token_ids_logprobs" not in meta and "input_token_ids_logprobs" not in meta
    vocab = _vocab(client)
    for value, message in (
        (["a"], "token_ids_logprob: must be a flat list of integers (token ids), or one such list per prompt"),
        ([vocab], f"token_ids_logprob: contains out-of-vocabulary token id {vocab}"),
        ([[1], [2]], "token_ids_logprob: must be a flat list of integers for a single prompt"),
    ):
        r = client.post("/generate", json={"text": "Hi", "return_logprob": True, "token_ids_logprob": value})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(message), r.text
