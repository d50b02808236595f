"""Gemma 2 and Gemma 3 text (tandem/models/gemma.py) against transformers on tiny random
models made with transformers' own config and model classes, their features switched on:
a sliding window (4 keys) shorter than the prompts on the sliding layers, attention and
final logit soft-caps, `query_pre_attn_scalar` other than head_dim, Gemma's (1 + w)
RMSNorm with non-zero weights, GELU-tanh MLP, tied embeddings; Gemma 3: q/k norms, a
local RoPE base other than the global one, and its sliding/global layer pattern.

fp32 greedy tokens equal transformers' `generate`, every step's logits within 1e-4 of
their largest: prefilled whole, in chunks (each chunk extends over the earlier ones' KV,
masked by the window), and through the scheduler with a radix-cache hit (the second
request's prefix KV reused, longer than the window)."""

from __future__ import annotations

import pytest
import torch
from runner_steps import (
    assert_greedy_matches_transformers,
    assert_radix_hit_matches_transformers,
    greedy_steps,
    make_runner,
    random_model,
    reference_model,
    spread_gemma,
)

PROMPTS = [[2, 5, 9, 13, 7, 7, 3, 11, 4, 30], [2, 8], list(range(1, 30))]
STEPS = 6
WINDOW = 4
COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    head_dim=32,
    max_position_embeddings=256,
    sliding_window=WINDOW,
    tie_word_embeddings=True,
)


def _gemma2(**over):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = dict(
        num_hidden_layers=3,
        num_key_value_heads=2,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
    )
    return _random(lambda: Gemma2ForCausalLM(Gemma2Config(**{**COMMON, **config, **over})), seed=0)


def _gemma3(**over):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = dict(
        num_hidden_layers=4,
        num_key_value_heads=1,
        query_pre_attn_scalar=32,
        final_logit_softcapping=8.0,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        },
    )
    return _random(lambda: Gemma3ForCausalLM(Gemma3TextConfig(**{**COMMON, **config, **over})), seed=1)


def _random(build, seed):
    """Seeded, its weights spread (the head is the tied embedding, widened there)."""
    return random_model(build, seed=seed, spread=spread_gemma, logit_scale=None)


FAMILIES = {"gemma2": _gemma2, "gemma3": _gemma3}


@pytest.fixture(scope="module")
def tiny_gemma2_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-gemma2"
    _gemma2().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "tiny-gemma3"
    _gemma3().save_pretrained(path)
    return path


def _reference(model_dir):
    return reference_model(model_dir, attn_implementation="eager")


def _check(model_dir, chunk=None, **runner_args):
    runner = make_runner(model_dir, dtype="float32", **runner_args)
    assert type(runner.model).__module__ == "tandem.models.gemma"
    got = greedy_steps(runner, PROMPTS, STEPS, chunk=chunk)
    assert_greedy_matches_transformers(got, _reference(model_dir), PROMPTS, STEPS)


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_greedy_and_logits_match_transformers(family, request):
    _check(request.getfixturevalue(f"tiny_{family}_dir"))


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_chunked_prefill_matches_transformers(family, request):
    _check(request.getfixturevalue(f"tiny_{family}_dir"), chunk=3)


def test_gemma_pytorch_decode_path_matches_transformers(tiny_gemma2_dir, monkeypatch):
    """Without the C++ decode kernel (torch_native's PyTorch decode, explicit scores)."""
    monkeypatch.setenv("TANDEM_DISABLE_CPU_KERNELS", "1")
    from tandem.kernels import cpu as cpu_kernels

    cpu_kernels.load.cache_clear()
    try:
        _check(tiny_gemma2_dir)
    finally:
        monkeypatch.delenv("TANDEM_DISABLE_CPU_KERNELS")
        cpu_kernels.load.cache_clear()


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_gemma_radix_hit_matches_transformers(family, request):
    """Through the scheduler: a prompt, then one sharing its first 20 tokens (its prefix KV
    from the radix cache, five windows long), greedy; outputs as transformers'."""
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    assert_radix_hit_matches_transformers(model_dir, _reference(model_dir), STEPS)


@pytest.mark.slow  # two gloo ranks in subprocesses
def test_gemma_on_two_ranks_equals_one(tmp_path):
    """TP 2 (Gemma 2: two KV heads split; Gemma 3: one, replicated): the logits of a prefill
    longer than the window and of decode steps equal TP 1's, and the ranks agree exactly."""
    from test_parallel_layers import _generate_on_rank, run_on_ranks

    from tandem.distributed import TpGroup

    dirs = []
    for family, build in FAMILIES.items():
        build(vocab_size=1536).save_pretrained(tmp_path / family)  # test_parallel_layers' prompts
        dirs.append(str(tmp_path / family))
    single = _generate_on_rank(TpGroup(), dirs)
    ranks = run_on_ranks(_generate_on_rank, 2, tmp_path / "ranks", dirs)
    for d in dirs:
        for r in ranks:
            for got, want in zip(r[d]["logits"], single[d]["logits"]):
                torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())
        assert all(torch.equal(a, b) for a, b in zip(ranks[0][d]["logits"], ranks[1][d]["logits"])), d
