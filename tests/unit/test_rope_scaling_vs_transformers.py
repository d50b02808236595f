"""A tiny random Llama with each `rope_scaling` kind, served by Tandem against
transformers' generate on the same directory: fp32 greedy tokens equal, every step's
logits within 1e-4 of their largest. `original_max_position_embeddings` (32) is shorter
than the longer prompts, so the scaled frequencies matter. `dynamic` is checked against
transformers on plain RoPE with the base Tandem (as SGLang) scales once
(tandem/layers/rotary.py): transformers' own dynamic NTK rescales per forward."""

from __future__ import annotations

import json

import pytest
from runner_steps import assert_greedy_matches_transformers, greedy_steps, make_runner, random_model

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6
MAX_POS, ORIG, HEAD_DIM = 128, 32, 16

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 8,
        "beta_slow": 2,
    },
}


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """One random Llama's weights, saved once per scaling kind."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=384,
        hidden_size=HEAD_DIM * 4,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POS,
        tie_word_embeddings=False,
    )
    model = random_model(lambda: LlamaForCausalLM(config))
    base = tmp_path_factory.mktemp("models")

    def save(name: str, rope_scaling: dict | None, rope_theta: float = 10000.0):
        path = base / name
        model.save_pretrained(path)
        cfg = json.loads((path / "config.json").read_text())
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = rope_theta
        cfg["rope_scaling"] = rope_scaling
        (path / "config.json").write_text(json.dumps(cfg))
        return path

    return save


def assert_equal_to(ours, ref_dir):
    got = greedy_steps(make_runner(ours, dtype="float32"), PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, ref_dir, PROMPTS, STEPS)


@pytest.mark.parametrize("kind", sorted(k for k in SCALINGS if k != "dynamic"))
def test_scaled_llama_matches_transformers(tiny_llama, kind):
    path = tiny_llama(kind, SCALINGS[kind])
    assert_equal_to(path, path)


def test_dynamic_llama_is_plain_rope_at_the_scaled_base(tiny_llama):
    factor = SCALINGS["dynamic"]["factor"]
    longest = MAX_POS * factor
    base = 10000.0 * ((factor * longest / MAX_POS) - (factor - 1)) ** (HEAD_DIM / (HEAD_DIM - 2))
    ours = tiny_llama("dynamic", SCALINGS["dynamic"])
    assert_equal_to(ours, tiny_llama("dynamic-reference", None, rope_theta=base))
