"""The default model (SmolLM2-135M-Instruct, the Q4_1 GGUF file) on the quantized CPU
kernels stays close to the same model dequantized, in bfloat16 (the default dtype on
this CPU) and float32.

Per dtype, two in-process Engines on the file: the quantized one (`linear_backend="auto"`:
GGUF blocks kept quantized) with no forward over `QUANT_MAX_ROWS` rows
(`chunked_prefill_size` and `max_running_requests` both that), so that every matmul of its
prefills, decode steps and LM head runs on the quantized kernel; the dequantized one
(`linear_backend="torch"`: the dense dequantized weights only, default chunking).

- Greedy chat answers agree with the dequantized model's (`test_greedy_tokens_agree` states
  the bounds).
- The perplexity of `tests/data/pride_and_prejudice_ch1.txt` (the opening of Pride and
  Prejudice, 590 tokens) is within 1% of the dequantized model's. The quantized engine scores
  it through the prompt logprobs of requests that each compute `QUANT_MAX_ROWS` positions:
  prompt logprobs are never chunked, so request k is the text's first `s + 3` tokens
  (`s = 1 + 3k`), scoring tokens `[s, s + 3)` with `logprob_start_len=s`, and the prefix cache
  holds its first `s - 1` positions (the previous request computed them; `cached_tokens`
  says so). The dequantized engine scores the text in one forward.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.quantization.gguf_linear import QUANT_MAX_ROWS
from tandem.tools.default_model import fetch_default_model
from tandem.tools.paths import repo_root

pytestmark = pytest.mark.skipif(
    cpu_kernels.load() is None, reason="Tandem's C++ CPU kernels are not built (no compiler): no quantized kernel"
)

TEXT = Path(__file__).parent.parent / "data" / "pride_and_prejudice_ch1.txt"
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "Give me a short tip for learning to cook.",
    "Explain what a prime number is.",
    "Why is the sky blue?",
    "What is the largest planet in the solar system?",
    "How do plants make their food?",
]
MAX_TOKENS = 32
GREEDY = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
ONE_TOKEN = {"max_new_tokens": 1, "temperature": 0}

# dtype: (the widest near tie: an answer may leave the dequantized model's only at a token
# whose top two logprobs there are at most this far apart; answers equal entirely (of 8), at
# least; the share of the dequantized answers' tokens in the leading runs that agree, at least).
GREEDY_BOUNDS = {"float32": (0.01, 6, 0.90), "bfloat16": (0.3, 0, 0.20)}
# dtype: the most the perplexity may differ from the dequantized model's, relative.
PERPLEXITY_BOUNDS = {"float32": 0.001, "bfloat16": 0.01}


@pytest.fixture(scope="module")
def model_file() -> Path:
    return fetch_default_model(repo_root() / "models")


@pytest.fixture(scope="module")
def tokenizer(model_file):
    from tandem.utils.tokenizer import load_tokenizer

    return load_tokenizer(str(model_file))


@pytest.fixture(scope="module", params=["bfloat16", "float32"])
def engines(request, model_file):
    """(dtype, quantized engine, dequantized engine), on one compute thread each
    (OMP_NUM_THREADS=1 for their processes: on a shared two-core machine two threads per
    forward mostly wait for each other), shut down after the dtype's tests."""
    from tandem import Engine

    common = dict(model_path=str(model_file), dtype=request.param, random_seed=0, max_total_tokens=4096)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # read by the subprocesses as they start
    try:
        quantized = Engine(
            **common, linear_backend="auto", chunked_prefill_size=QUANT_MAX_ROWS, max_running_requests=QUANT_MAX_ROWS
        )
        try:
            dequantized = Engine(**common, linear_backend="torch")
        except BaseException:
            quantized.shutdown()
            raise
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    with quantized, dequantized:
        yield request.param, quantized, dequantized


def chat_prompts(tokenizer) -> list[list[int]]:
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


def leading_equal(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_greedy_tokens_agree(engines, tokenizer):
    """The 8 chat answers (greedy, up to 32 tokens, ending at the end of the turn) against
    the dequantized model's, token by token: an answer may leave the dequantized one only at
    a near tie of the dequantized model (its top two logprobs at that token within 0.01 in
    float32, 0.3 in bfloat16); and at least, float32: 6 of 8 answers equal entirely, 90% of
    the dequantized answers' tokens in the leading runs that agree; bfloat16: 20% of them.
    Measured, float32: all 8 answers equal (213 of 213 tokens). bfloat16: leading runs of 0,
    5, 13, 0, 12, 1, 15, 10 tokens (56 of 210, 27%), no answer equal entirely; the dequantized
    model's margins where they part: 0.25, 0.125 (six), 0 (an exact tie in bfloat16's logits).
    (With PyTorch's SDPA for prefill attention, which rounds its softmax weights to bfloat16,
    the two agreed on 105-132 of 210 tokens: both carried that same rounding. Tandem's C++
    prefill kernel keeps them in float32, and against the float32 dequantized model's answers
    the bfloat16 dequantized model's leading runs rose from 64 to 143 of 210 tokens.)
    In float32 the kernel multiplies float32 rows by the exact dequantized weights (only the
    order of the sums differs), so only a near-tie may flip, late. In bfloat16 the models
    differ by more: the dense weights are the dequantized values rounded to bfloat16, the
    kernel quantizes the rows to int8 per 32 (llama.cpp's recipe), and every layer rounds its
    output to bfloat16, so a change of summation order anywhere moves logits by a few
    bfloat16 steps and flips this model's close seconds (the capital-of-France answer's first
    token is one: 0.125 apart). A wrong kernel (a wrong scale, block or row) parts from the
    dequantized answers at tokens the model is sure of, and fails."""
    dtype, quantized, dequantized = engines
    prompts = chat_prompts(tokenizer)
    got = [o["output_ids"] for o in quantized.generate(input_ids=prompts, sampling_params=GREEDY)]
    ref = dequantized.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=2)
    want = [o["output_ids"] for o in ref]
    lead = [leading_equal(g, w) for g, w in zip(got, want)]
    near_tie, min_whole, min_share = GREEDY_BOUNDS[dtype]
    # the dequantized model's top-two margin where each answer parts from it (None: it does not)
    margins = []
    for o, n, w in zip(ref, lead, want):
        top = o["meta_info"]["output_top_logprobs"][n] if n < len(w) else None
        margins.append(None if top is None else round(top[0][0] - top[1][0], 4))
    whole = sum(g == w for g, w in zip(got, want))
    total = sum(len(w) for w in want)
    report = (
        f"{dtype}: leading runs equal {lead} of {[len(w) for w in want]} tokens "
        f"({sum(lead)} of {total}), {whole} answers equal, margins where they part {margins}"
    )
    print(report)
    assert all(m is None or m <= near_tie for m in margins), report
    assert whole >= min_whole, report
    assert sum(lead) >= min_share * total, report


def test_perplexity_within_one_percent(engines, tokenizer):
    """The quantized model's perplexity of the text, scored in forwards of `QUANT_MAX_ROWS`
    rows, is within 1% of the dequantized model's in bfloat16, within 0.1% in float32 (the
    kernel's exact float path). Measured: bfloat16 17.050 vs 17.012 (+0.22%), float32 17.0047
    for both (+1.4e-7)."""
    dtype, quantized, dequantized = engines
    ids = tokenizer.encode(TEXT.read_text())
    assert 400 <= len(ids) <= 700
    full = dequantized.generate(input_ids=ids, sampling_params=ONE_TOKEN, return_logprob=True, logprob_start_len=0)
    want = [entry[0] for entry in full["meta_info"]["input_token_logprobs"][1:]]

    stride = QUANT_MAX_ROWS - 1  # tokens scored per request: one more position is computed
    starts = list(range(1, len(ids), stride))
    outs = quantized.generate(
        input_ids=[ids[: s + stride] for s in starts],
        sampling_params=ONE_TOKEN,
        return_logprob=True,
        logprob_start_len=starts,
    )
    got = []
    for s, out in zip(starts, outs):
        meta = out["meta_info"]
        # It computed positions [s - 1, s + stride): at most QUANT_MAX_ROWS rows per matmul.
        assert meta["cached_tokens"] == s - 1, (s, meta["cached_tokens"])
        got += [entry[0] for entry in meta["input_token_logprobs"]]
    assert len(got) == len(want) == len(ids) - 1

    ppl_got, ppl_want = (math.exp(-sum(lps) / len(lps)) for lps in (got, want))
    report = f"{dtype}: perplexity quantized {ppl_got:.5f}, dequantized {ppl_want:.5f} ({ppl_got / ppl_want - 1:+.2e})"
    print(report)
    assert ppl_want < 30, report  # natural English, which the model reads well
    assert abs(ppl_got / ppl_want - 1) < PERPLEXITY_BOUNDS[dtype], report


# fp8 KV cache (--kv-cache-dtype, no scales): the most its perplexity may differ from the
# dequantized model's (float32, float32 cache), relative. Measured: fp8_e4m3 -0.011% (fp8_e5m2,
# not run here to keep the suite's time: +2.54%, docs/perf-log/kv-cache-dtype.md).
FP8_PERPLEXITY_BOUNDS = {"fp8_e4m3": 0.01}


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8_PERPLEXITY_BOUNDS))
def test_an_fp8_kv_cache_keeps_the_perplexity_close(engines, tokenizer, model_file, kv_cache_dtype):
    """The quantized model with its keys and values in fp8 (float32 activations; the text scored
    in one forward, which reads the prompt's keys back from the fp8 pool) against the dequantized
    model with a float32 cache. (fp8_e5m2's rounding is checked on the tiny model:
    tests/unit/test_kv_cache_dtype.py.)"""
    from tandem import Engine

    dtype, _, dequantized = engines
    if dtype != "float32":
        pytest.skip("measured against the float32 reference")
    ids = tokenizer.encode(TEXT.read_text())
    score = dict(input_ids=ids, sampling_params=ONE_TOKEN, return_logprob=True, logprob_start_len=0)

    def perplexity(out) -> float:
        lps = [entry[0] for entry in out["meta_info"]["input_token_logprobs"][1:]]
        assert len(lps) == len(ids) - 1
        return math.exp(-sum(lps) / len(lps))

    want = perplexity(dequantized.generate(**score))
    with Engine(model_path=str(model_file), dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_total_tokens=4096) as fp8:
        got = perplexity(fp8.generate(**score))
    report = (
        f"{kv_cache_dtype}: perplexity {got:.5f}, dequantized with a float32 cache {want:.5f} ({got / want - 1:+.2e})"
    )
    print(report)
    assert abs(got / want - 1) < FP8_PERPLEXITY_BOUNDS[kv_cache_dtype], report
