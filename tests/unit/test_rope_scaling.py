"""RoPE scaling (tandem/layers/rotary.py) against transformers' own rotary embedding
classes on the same config, for positions 0..N past `original_max_position_embeddings`:
linear, dynamic (SGLang's one table: transformers' at the longest sequence), llama3, yarn
(attention factor, mscale, beta_fast/beta_slow, truncate) and longrope (short factors
below the original length, long ones from it on); and `models/base.rope_settings` on both
config forms. tests/unit/test_rope_scaling_vs_transformers.py serves tiny models."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from tandem.layers.rotary import RotaryEmbedding
from tandem.models.base import make_rotary_embedding, rope_settings

HEAD_DIM = 32
MAX_POS = 256
ORIG = 64


def llama_config(scaling: dict | None, **kw) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_theta=10000.0,
        rope_scaling=scaling,
        **kw,
    )


def tandem_cos_sin(rope: RotaryEmbedding, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's first `n` rows in transformers' form: cos and (unsigned) sin, [n, dim]."""
    table = rope.cos_sin_cache[:n]
    half = rope.rotary_dim // 2
    return table[:, 0], table[:, 1, half:].repeat(1, 2)


def hf_cos_sin(hf_rope, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, positions.numel(), HEAD_DIM)
    cos, sin = hf_rope(x, positions.unsqueeze(0))
    return cos[0], sin[0]


def assert_tables_close(ours, ref):
    # float32 angles up to ~MAX_POS radians: transformers computes inv_freq in float32.
    torch.testing.assert_close(ours[0], ref[0], atol=2e-5, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=2e-5, rtol=0)


LLAMA_KINDS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIG,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
    "yarn-betas-no-truncate": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": ORIG,
        "mscale": 0.707,
        "mscale_all_dim": 1.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": ORIG,
        "attention_factor": 0.8,
    },
    "qwen2.5-yarn-old-form": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
}


@pytest.mark.parametrize("name", sorted(LLAMA_KINDS))
def test_scaled_tables_equal_transformers(name):
    config = llama_config(dict(LLAMA_KINDS[name]))
    rope = make_rotary_embedding(config)
    positions = torch.arange(MAX_POS)
    hf = LlamaRotaryEmbedding(config)
    if "yarn" in name:
        assert hf.attention_scaling != 1.0
    assert_tables_close(tandem_cos_sin(rope, MAX_POS), hf_cos_sin(hf, positions))


def test_dynamic_is_transformers_table_at_the_longest_sequence():
    """transformers recomputes dynamic NTK per forward by its sequence length; Tandem (as
    SGLang) keeps the one table of the longest, `max_position_embeddings * factor`."""
    config = llama_config({"rope_type": "dynamic", "factor": 2.0})
    rope = make_rotary_embedding(config)
    longest = MAX_POS * 2
    assert rope.cos_sin_cache.shape[0] == longest
    hf = LlamaRotaryEmbedding(config)
    ref = hf_cos_sin(hf, torch.arange(longest))
    ours = tandem_cos_sin(rope, longest)
    torch.testing.assert_close(ours[0], ref[0], atol=5e-5, rtol=0)
    torch.testing.assert_close(ours[1], ref[1], atol=5e-5, rtol=0)
    # below max_position_embeddings transformers uses the plain base; Tandem does not
    plain = hf_cos_sin(LlamaRotaryEmbedding(llama_config(None)), torch.arange(MAX_POS))
    assert not torch.allclose(ours[0][:MAX_POS], plain[0], atol=1e-3)


def phi3_config(**kw) -> Phi3Config:
    half = HEAD_DIM // 2
    return Phi3Config(
        hidden_size=HEAD_DIM * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        original_max_position_embeddings=ORIG,
        rope_scaling={
            "type": "longrope",
            "short_factor": [1.0 + 0.05 * i for i in range(half)],
            "long_factor": [1.0 + 0.9 * i for i in range(half)],
        },
        **kw,
    )


def test_longrope_short_below_original_long_from_it_on():
    config = phi3_config()
    theta, scaling = rope_settings(config)
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == ORIG
    rope = make_rotary_embedding(config)
    ours = tandem_cos_sin(rope, MAX_POS)
    # transformers: the short set while the sequence fits the original length ...
    short = hf_cos_sin(Phi3RotaryEmbedding(config), torch.arange(ORIG))
    assert_tables_close((ours[0][:ORIG], ours[1][:ORIG]), short)
    # ... the long set (and attention factor) once it is longer, for every position
    hf = Phi3RotaryEmbedding(config)
    assert hf.attention_scaling > 1.0
    long = hf_cos_sin(hf, torch.arange(MAX_POS))
    assert_tables_close((ours[0][ORIG:], ours[1][ORIG:]), (long[0][ORIG:], long[1][ORIG:]))
    # a decode step at each position past the original length (one position per forward)
    for p in (ORIG, ORIG + 1, MAX_POS - 1):
        step = hf_cos_sin(Phi3RotaryEmbedding(config), torch.tensor([p]))
        assert_tables_close((ours[0][p : p + 1], ours[1][p : p + 1]), step)


def test_longrope_explicit_attention_factor():
    config = phi3_config()
    config.rope_parameters["attention_factor"] = 1.3
    ours = tandem_cos_sin(make_rotary_embedding(config), ORIG)
    hf = Phi3RotaryEmbedding(config)
    assert hf.attention_scaling == 1.3
    assert_tables_close(ours, hf_cos_sin(hf, torch.arange(ORIG)))


def test_rope_settings_both_config_forms():
    """The old `rope_scaling` key and transformers 5's `rope_parameters` read the same;
    default RoPE is no scaling."""
    scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}
    new = llama_config(dict(scaling), rope_parameters=None)
    theta, got = rope_settings(new)
    assert theta == 10000.0 and {k: got[k] for k in scaling} == scaling

    class OldForm:  # a plain config object of the old form, no rope_parameters
        rope_theta = 500000.0
        rope_scaling = {"type": "linear", "factor": 2.0}

    assert rope_settings(OldForm()) == (500000.0, {"type": "linear", "factor": 2.0})

    class NewForm:
        rope_parameters = {"rope_theta": 1e6, "rope_type": "default"}

    assert rope_settings(NewForm()) == (1e6, None)
    assert rope_settings(llama_config(None)) == (10000.0, None)


def test_unknown_kind_refused():
    with pytest.raises(ValueError, match="not supported"):
        RotaryEmbedding(HEAD_DIM, HEAD_DIM, 16, 10000.0, {"rope_type": "mystery"})
