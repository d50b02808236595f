"""Phi-3 (tandem/models/phi3.py) against transformers on tiny random models made with
transformers' own Phi3Config/Phi3ForCausalLM, plain RoPE (the 4k models) and longrope
(the 128k ones): fp32 greedy tokens equal and every step's logits within 1e-4 of their
largest. The longrope model's prompts and generations stay within
`original_max_position_embeddings`, where transformers uses the short factors for the
whole sequence as Tandem does (the long ones are checked position by position in
tests/unit/test_rope_scaling.py). A sliding window shorter than the prompts and partial
rotary (prefilled whole and in chunks). The fused qkv/gate_up checkpoint tensors load split
into their parts, on one rank and on two."""

from __future__ import annotations

import pytest
import torch
from runner_steps import (
    assert_greedy_matches_transformers,
    greedy_steps,
    make_runner,
    reference_model,
    save_random_model,
)
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tandem.models.phi3 import Phi3ForCausalLM, RowRange

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6
HEAD_DIM = 16


def phi3_config(longrope: bool, **over):
    from transformers import Phi3Config

    half = HEAD_DIM // 2
    scaling = None
    if longrope:
        scaling = {
            "type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.0 + 2.0 * i for i in range(half)],
        }
    return Phi3Config(
        vocab_size=384,
        hidden_size=HEAD_DIM * 4,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512 if longrope else 64,
        original_max_position_embeddings=64,
        rope_scaling=scaling,
        **{
            "sliding_window": None,
            "tie_word_embeddings": False,
            "pad_token_id": 0,
            "eos_token_id": None,
            "bos_token_id": 1,
            **over,
        },
    )


@pytest.fixture(scope="module", params=["plain", "longrope"])
def tiny_phi3_dir(request, tmp_path_factory):
    from transformers import Phi3ForCausalLM as HFPhi3

    path = tmp_path_factory.mktemp("models") / f"tiny-phi3-{request.param}"
    return save_random_model(path, lambda: HFPhi3(phi3_config(request.param == "longrope")))


def test_phi3_greedy_and_logits_match_transformers(tiny_phi3_dir):
    runner = make_runner(tiny_phi3_dir, dtype="float32")
    assert type(runner.model).__module__ == "tandem.models.phi3"
    got = greedy_steps(runner, PROMPTS, STEPS)
    assert_greedy_matches_transformers(got, tiny_phi3_dir, PROMPTS, STEPS)


@pytest.mark.parametrize("chunk", [None, 7])
def test_phi3_window_and_partial_rotary_match_transformers(tmp_path, chunk):
    """`sliding_window` shorter than the prompts (every layer, as transformers applies it),
    prefilled whole and in chunks, and half of each head rotated (`partial_rotary_factor`,
    as Phi-4-mini's 0.75)."""
    from transformers import Phi3ForCausalLM as HFPhi3

    config = phi3_config(False, sliding_window=8, partial_rotary_factor=0.5)
    model_dir = save_random_model(tmp_path / "phi3-window", lambda: HFPhi3(config), seed=3)
    runner = make_runner(model_dir, dtype="float32")
    assert runner.model.model.rotary_emb.rotary_dim == HEAD_DIM // 2
    assert runner.model.model.layers[0].self_attn.sliding_window == 8
    got = greedy_steps(runner, PROMPTS, STEPS, chunk=chunk)
    assert_greedy_matches_transformers(got, reference_model(model_dir, attn_implementation="eager"), PROMPTS, STEPS)


def test_fused_tensors_split_per_rank(tiny_phi3_dir):
    """Under TP 2 each rank's fused qkv holds its own q heads, then its own k and v heads
    (and gate_up its own gate rows, then its own up rows), cut from the checkpoint's
    concatenation part by part."""
    config = AutoModelForCausalLM.from_pretrained(str(tiny_phi3_dir)).config
    state = load_file(str(tiny_phi3_dir / "model.safetensors"))
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"]
    gate_up = state["model.layers.0.mlp.gate_up_proj.weight"]
    q_total, kv_total, inter = 4 * HEAD_DIM, 2 * HEAD_DIM, config.intermediate_size
    q, k, v = qkv.split([q_total, kv_total, kv_total])
    gate, up = gate_up.split([inter, inter])
    for rank in range(2):
        model = Phi3ForCausalLM(config, tp_rank=rank, tp_size=2)
        model.load_weights(state.items())
        got = model.model.layers[0].self_attn.qkv_proj.weight
        want = torch.cat([q.chunk(2)[rank], k.chunk(2)[rank], v.chunk(2)[rank]])
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        got = model.model.layers[0].mlp.gate_up_proj.weight
        torch.testing.assert_close(got, torch.cat([gate.chunk(2)[rank], up.chunk(2)[rank]]), atol=0, rtol=0)


def test_row_range_reads_only_its_rows():
    t = torch.arange(20.0).view(10, 2)
    rows = RowRange(t, 3, 4)
    torch.testing.assert_close(rows[...], t[3:7])
    torch.testing.assert_close(rows[1:3], t[4:6])
    torch.testing.assert_close(rows[(slice(None), slice(1, 2))], t[3:7, 1:2])
