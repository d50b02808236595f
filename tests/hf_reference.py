"""Reference outputs from Hugging Face transformers on the same weights (fp32)."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


@functools.lru_cache(maxsize=4)
def load(model_dir: str):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return tok, model


@torch.inference_mode()
def greedy_ids(model_dir: str, prompt_ids: list[int], max_new_tokens: int, **generate_kwargs) -> list[int]:
    """HF greedy `generate` output ids, cut after the first EOS (inclusive).

    `generate_kwargs` go to `generate` (e.g. repetition_penalty, logits_processor)."""
    _, model = load(str(model_dir))
    eos = model.generation_config.eos_token_id
    eos = {eos} if isinstance(eos, int) else set(eos or [])
    out = model.generate(
        torch.tensor([prompt_ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        **generate_kwargs,
    )
    ids = out[0, len(prompt_ids) :].tolist()
    for i, t in enumerate(ids):
        if t in eos:
            return ids[: i + 1]
    return ids


def encode(model_dir: str, text: str) -> list[int]:
    tok, _ = load(str(model_dir))
    return tok(text).input_ids
