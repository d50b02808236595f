"""Tokenizer loading, the set of ids that end generation, and the most characters one
token can cover."""

from __future__ import annotations

import json
import os
import re

from transformers import AutoTokenizer

# A UTF-16 surrogate code point: in a Python str, always one without its pair (JSON's
# "\ud800" escape), which is not valid Unicode and which tokenizers refuse.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def load_tokenizer(path: str):
    """The tokenizer of a Hugging Face directory, or the one transformers builds from a GGUF
    file's metadata (with its special tokens and chat template; cached on first use)."""
    from tandem.model_executor.gguf_loader import hf_view

    return AutoTokenizer.from_pretrained(hf_view(path))


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


# How many input characters each normalizer may merge into one (None: it may delete
# characters, so no bound). Unicode composition (NFC, NFKC) joins at most 4 code points
# into one (U+1F82 decomposes to 4); the other listed ones never shorten a text.
_NORMALIZER_SHRINK = {
    "NFC": 4,
    "NFKC": 4,
    "NFD": 1,
    "NFKD": 1,
    "Lowercase": 1,
    "Prepend": 1,
    "Append": 1,
    "ByteLevel": 1,
}
# Pre-tokenizers that drop characters (whitespace, delimiters): no bound with them.
_DROPPING_PRE_TOKENIZERS = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


def max_chars_per_token(tokenizer) -> int | None:
    """The most characters of input text that one token can stand for, or None when this
    tokenizer gives no such bound (it may drop characters or fold unknown runs into one).

    A text of C characters then has at least ceil(C / bound) tokens, so a prompt longer
    than (most tokens that fit) x bound characters can be refused before tokenizing it,
    and a prompt that could fit is never refused. Read from the fast tokenizer's JSON:
    the longest vocabulary entry (added tokens included; byte-level entries have one
    character per byte, which covers at least one character), times what the normalizer
    may merge.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_every_character(spec):
        return None
    longest = max(len(piece) for piece in tokenizer.get_vocab())
    return longest * shrink


def _normalizer_shrink(spec: dict | None) -> int | None:
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers", []):
            factor = _normalizer_shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if pattern is None or not content:  # a regex, or a deletion
            return None
        return -(-len(pattern) // len(content))
    return _NORMALIZER_SHRINK.get(kind)


def _pre_tokenizers(spec: dict | None) -> list[dict]:
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        return [p for part in spec.get("pretokenizers", []) for p in _pre_tokenizers(part)]
    return [spec]


def _keeps_every_character(spec: dict) -> bool:
    """Every input character ends up in some token: nothing dropped by pre-tokenization,
    and an unknown character becomes bytes (byte fallback, byte-level) or its own unk token."""
    pre = _pre_tokenizers(spec.get("pre_tokenizer"))
    if any(p.get("type") in _DROPPING_PRE_TOKENIZERS or p.get("behavior") == "Removed" for p in pre):
        return False
    model = spec.get("model") or {}
    if model.get("type") != "BPE":  # WordPiece/WordLevel/Unigram may fold a long unknown run into one token
        return bool(model.get("byte_fallback"))
    byte_level = any(p.get("type") == "ByteLevel" for p in pre)
    return bool(model.get("byte_fallback") or byte_level or (model.get("unk_token") and not model.get("fuse_unk")))
