"""Mistral (tandem/models/mistral.py) against transformers on a tiny random model made
with transformers' own MistralConfig/MistralForCausalLM: fp32 greedy tokens equal and
every step's logits within 1e-4 of their largest, with a window longer than the prompts and
generations and with one (5 keys) shorter than most of them."""

from __future__ import annotations

import pytest
import torch
from runner_steps import greedy_steps, make_runner
from transformers import AutoModelForCausalLM

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 6


@pytest.fixture(scope="module", params=[4096, 5], ids=["long-window", "window-5"])
def tiny_mistral_dir(tmp_path_factory, request):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
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
    model = MistralForCausalLM(config)
    with torch.no_grad():  # spread the logits (random init leaves them near-uniform)
        model.lm_head.weight.mul_(20)
    path = tmp_path_factory.mktemp("models") / f"tiny-mistral-{request.param}"
    model.save_pretrained(path)
    return path


def test_mistral_greedy_and_logits_match_transformers(tiny_mistral_dir):
    runner = make_runner(tiny_mistral_dir, dtype="float32")
    assert type(runner.model).__module__ == "tandem.models.mistral"
    ids, logits = greedy_steps(runner, PROMPTS, STEPS)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_mistral_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    for i, prompt in enumerate(PROMPTS):
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                max_new_tokens=STEPS,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                output_logits=True,
                return_dict_in_generate=True,
            )
        assert ids[i] == out.sequences[0, len(prompt) :].tolist(), f"prompt {i}"
        for step, ref in enumerate(out.logits):
            ref = ref[0].float()
            torch.testing.assert_close(logits[step][i], ref, atol=1e-4 * ref.abs().max().item(), rtol=0)
