"""Tensor parallelism on real servers (--tp-size 2: two scheduler processes, gloo on CPU).

Greedy tokens and logprobs equal --tp-size 1's (the session server) on the tiny llama
(heads, KV heads, vocabulary and intermediate size divide by 2); the one-KV-head model,
whose KV head both ranks hold, equals transformers; seeded sampling equals --tp-size 1's
with the same seeds, through chunked prefill (8-token chunks) and radix-cache hits; each
rank is its own named process, and killing one takes the whole server down at once,
leaving nothing behind. GGUF files (llama Q4_K, whose Q/K rows llama.cpp permutes, and
qwen2 Q8_0) give --tp-size 1's greedy tokens and logprobs (fp32), also with
--dp-size 2 --tokenizer-worker-num 2 around the TP groups."""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import hf_reference
import httpx
import psutil
import pytest
import torch
from gguf_writer import write_gguf
from runner_steps import greedy_steps, make_runner
from server_launcher import ServerHandle

from tandem.model_executor.gguf_loader import iterate_gguf_weights
from tandem.tools.make_tiny_model import make_tiny_model
from tandem.utils.tokenizer import load_tokenizer

PROMPTS = [
    "Hello",
    "Once upon a time, in a land far away, there lived a small dragon who loved to read books about the sea.",
    "1 2 3 4 5",
]
MAX_NEW_TOKENS = 24
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def tp2_server(tiny_llama_dir):
    with ServerHandle(tiny_llama_dir, extra_args=["--tp-size", "2", "--chunked-prefill-size", "8"]) as handle:
        yield handle


def _generate(base_url: str, prompt: str, logprobs: bool = True, **sampling) -> dict:
    """Prompt logprobs keep a request from being chunked: ask for them only with `logprobs`."""
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3} if logprobs else {}
    r = httpx.post(
        base_url + "/generate",
        timeout=120,
        json={"text": prompt, **extra, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, **sampling}},
    )
    assert r.status_code == 200, r.text
    return r.json()


def _assert_logprobs_close(got: list, want: list) -> None:
    """[[logprob, token_id, text], ...] entries: same ids, logprobs within tolerance."""
    assert [e[1] for e in got] == [e[1] for e in want]
    for g, w in zip(got, want):
        if w[0] is None:
            assert g[0] is None
        else:
            assert abs(g[0] - w[0]) < LOGPROB_TOL, (g, w)


def test_greedy_tokens_and_logprobs_equal_tp1(server, tp2_server):
    for prompt in PROMPTS:
        one = _generate(server.base_url, prompt, temperature=0)
        two = _generate(tp2_server.base_url, prompt, temperature=0)
        assert two["output_ids"] == one["output_ids"], prompt
        assert two["text"] == one["text"]
        m1, m2 = one["meta_info"], two["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs"):
            _assert_logprobs_close(m2[key], m1[key])
        for key in ("output_top_logprobs", "input_top_logprobs"):
            assert len(m2[key]) == len(m1[key])
            for got, want in zip(m2[key], m1[key]):
                _assert_logprobs_close(got or [], want or [])


def test_seeded_sampling_equals_tp1(server, tp2_server):
    """Every rank samples from the same logits with the same generator states, so the
    tokens are those of one process given the same seeds."""
    for seed, prompt in enumerate(PROMPTS):
        params = {"temperature": 0.9, "top_p": 0.95, "sampling_seed": 100 + seed}
        one = _generate(server.base_url, prompt, logprobs=False, **params)
        two = [_generate(tp2_server.base_url, prompt, logprobs=False, **params) for _ in range(2)]
        assert two[0]["output_ids"] == two[1]["output_ids"] == one["output_ids"], prompt
        assert two[1]["meta_info"]["cached_tokens"] > 0  # the second one reused the first's prefix
    unseeded = {
        tuple(_generate(tp2_server.base_url, "Hello", logprobs=False, temperature=1.0)["output_ids"]) for _ in range(3)
    }
    assert len(unseeded) > 1  # unseeded requests still draw fresh noise


def test_constrained_outputs_equal_tp1(server, tp2_server):
    """Every rank compiles the grammar and admits the request in the same step (the
    grammar queue waits for the compile under TP), so both ranks mask alike."""
    regex = r"[a-z]{2,6}-[0-9]{2}"
    for seed, prompt in enumerate(PROMPTS):
        params = {"temperature": 0.9, "sampling_seed": 7 + seed, "regex": regex}
        one = _generate(server.base_url, prompt, logprobs=False, **params)
        two = _generate(tp2_server.base_url, prompt, logprobs=False, **params)
        assert two["output_ids"] == one["output_ids"] and re.fullmatch(regex, two["text"]), (one, two)


def test_replicated_kv_head_matches_transformers(tiny_mqa_dir):
    """One KV head, two ranks: each holds a copy of it."""
    expected = [
        hf_reference.greedy_ids(tiny_mqa_dir, hf_reference.encode(tiny_mqa_dir, p), MAX_NEW_TOKENS) for p in PROMPTS
    ]
    with ServerHandle(tiny_mqa_dir, extra_args=["--tp", "2", "--skip-server-warmup"]) as server:
        for prompt, ref in zip(PROMPTS, expected):
            assert _generate(server.base_url, prompt, temperature=0)["output_ids"] == ref, prompt


def test_one_process_per_rank_and_a_dead_rank_takes_the_server_down(tp2_server):
    children = {
        p.cmdline()[0]: p
        for p in psutil.Process(tp2_server.proc.pid).children(recursive=True)
        if p.cmdline()[0].startswith("tandem::")
    }
    assert set(children) == {"tandem::scheduler_TP0", "tandem::scheduler_TP1", "tandem::detokenizer"}
    [ipc_dir] = tp2_server.ipc_dirs()
    os.kill(children["tandem::scheduler_TP1"].pid, signal.SIGKILL)
    try:
        assert tp2_server.proc.wait(timeout=20) == 1, "the server kept running after a rank died"
    finally:
        survivors = tp2_server.stop(check=False)
    assert survivors == []
    assert not os.path.exists(ipc_dir)
    # The main process saw it die, or rank 0 failed in a collective first and reported it.
    log = tp2_server.log_tail(100)
    seen_by_main = "scheduler_TP1 died; shutting the server down" in log or "scheduler_TP1 exited)" in log
    reported_by_rank0 = "scheduler_TP0: a collective of the TP group failed: another rank died" in log
    assert seen_by_main or reported_by_rank0, log


GGUF_NEW_TOKENS = 8
GREEDY_TIE = 1e-4  # logits this close are a tie that float32 sums in another order may break either way


@pytest.mark.parametrize(
    "arch,qtype,extra",
    [
        ("llama", "Q4_K", ["--tp-size", "2", "--dp-size", "2", "--tokenizer-worker-num", "2"]),
        ("qwen2", "Q8_0", ["--tp-size", "2"]),
    ],
    ids=["llama-Q4_K-tp2-dp2-workers2", "qwen2-Q8_0-tp2"],
)
def test_gguf_greedy_equals_tp1(tiny_llama_gguf_dir, tmp_path, arch, qtype, extra):
    """The ranks un-permute llama's Q/K rows of the whole tensor before taking their
    heads' rows (tests/unit/test_gguf_loader.py checks each rank's shard); the reference
    is --tp-size 1 on the same file, in this process. Requests go concurrently over fresh
    connections, so both tokenizer workers and both DP replicas serve some."""
    model_dir = tiny_llama_gguf_dir if arch == "llama" else make_tiny_model(tmp_path / arch, arch=arch, preset="gguf")
    path = write_gguf(model_dir, tmp_path / f"{arch}-{qtype}.gguf", qtype)
    prompts = [load_tokenizer(str(path))(p).input_ids for p in PROMPTS]
    want_ids, logits = greedy_steps(make_runner(path, dtype="float32"), prompts, GGUF_NEW_TOKENS)
    with ServerHandle(path, extra_args=[*extra, "--dtype", "float32", "--skip-server-warmup"]) as server:

        def run(prompt: str) -> dict:
            r = httpx.post(
                server.base_url + "/generate",
                timeout=120,
                json={
                    "text": prompt,
                    "return_logprob": True,
                    "sampling_params": {"temperature": 0, "max_new_tokens": GGUF_NEW_TOKENS, "ignore_eos": True},
                },
            )
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outs = list(pool.map(run, PROMPTS * 2))
        embed = httpx.post(
            server.base_url + "/get_weights_by_name",
            timeout=60,
            json={"name": "model.embed_tokens.weight", "truncate_size": 3},
        )
    for i, out in enumerate(outs):
        n = i % len(PROMPTS)
        got = out["output_ids"]
        agree = next((s for s, (a, b) in enumerate(zip(got, want_ids[n])) if a != b), len(want_ids[n]))
        if agree < len(want_ids[n]):
            # Only at a tie: the concurrent requests make other batches than the reference's
            # (other prefill row counts for oneDNN's float32 GEMM), whose sums round apart by
            # ~1e-6; a random tiny model's logits can tie closer than that.
            top2 = logits[agree][n].double().topk(2).values
            assert top2[0] - top2[1] < GREEDY_TIE, (PROMPTS[n], agree, got, want_ids[n], top2.tolist())
        for step, (logprob, token, _) in enumerate(out["meta_info"]["output_token_logprobs"][:agree]):
            want = torch.log_softmax(logits[step][n], -1)[token].item()
            assert abs(logprob - want) < LOGPROB_TOL, (PROMPTS[n], step, logprob, want)
    assert embed.status_code == 200, embed.text
    rows = dict(iterate_gguf_weights(str(path), show_progress=False))["model.embed_tokens.weight"][:3]
    assert torch.allclose(torch.tensor(embed.json()), rows)
