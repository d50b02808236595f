"""Tokenizer loading and the set of ids that end generation."""

from __future__ import annotations

import json
import os

from transformers import AutoTokenizer


def load_tokenizer(path: str):
    return AutoTokenizer.from_pretrained(path)


def _as_set(value) -> set[int]:
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def get_eos_token_ids(config, tokenizer=None, model_path: str | None = None) -> set[int]:
    """EOS ids from config.json, generation_config.json and the tokenizer, united."""
    ids = _as_set(getattr(config, "eos_token_id", None))
    path = model_path or getattr(config, "_name_or_path", None)
    gen_path = os.path.join(path, "generation_config.json") if path else None
    if gen_path and os.path.isfile(gen_path):
        with open(gen_path) as f:
            ids |= _as_set(json.load(f).get("eos_token_id"))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids
