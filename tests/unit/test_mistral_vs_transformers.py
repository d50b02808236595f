"""Mistral (tandem/models/mistral.py) against transformers on a tiny random model made
with transformers' own MistralConfig/MistralForCausalLM: fp32 greedy tokens equal and
every step's logits within 1e-4 of their largest, with a window longer than the prompts and
generations and with one (5 keys) shorter than most of them."""

from __future__ import annotations

import pytest
from runner_steps import assert_greedy_matches_transformers, greedy_steps, make_runner, save_random_model

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6


@pytest.fixture(scope="module", params=[4096, 5], ids=["long-window", "window-5"])
def tiny_mistral_dir(tmp_path_factory, request):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=384,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=request.param,
        tie_word_embeddings=False,
    )
    path = tmp_path_factory.mktemp("models") / f"tiny-mistral-{request.param}"
    return save_random_model(path, lambda: MistralForCausalLM(config))


def test_mistral_greedy_and_logits_match_transformers(tiny_mistral_dir):
    runner = make_runner(tiny_mistral_dir, dtype="float32")
    assert type(runner.model).__module__ == "tandem.models.mistral"
    got = greedy_steps(runner, PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, tiny_mistral_dir, PROMPTS, STEPS)
