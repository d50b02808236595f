"""Benchmark workloads made of token ids, so every engine does exactly the same work.

Prompts are token ids drawn uniformly from the tokenizer's ordinary (non-special) ids
and sent as ids (never as text), so no re-tokenization can change their length; with
`ignore_eos` the output lengths are fixed too. Everything is a pure function of a seed.

Workloads (the `--dataset-name` of `bench_serving`):
  random         `num_prompts` prompts; input and output lengths each uniform in
                 [max(1, int(range_ratio * len)), len] (SGLang's `--random-range-ratio`).
  shared-prefix  `num_groups` groups of `prompts_per_group` prompts; the prompts of a
                 group share a `system_prompt_len`-token prefix followed by their own
                 `question_len` tokens (SGLang's generated-shared-prefix dataset). The
                 prompts of all groups are shuffled together, as SGLang does.
Request arrival times (`--request-rate`) come from `arrival_offsets`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BenchRequest:
    prompt_ids: list[int]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class TokenSpace:
    """The ids prompts may use: [0, vocab_size) minus the special ids."""

    vocab_size: int
    special_ids: frozenset[int] = frozenset()

    def allowed_ids(self) -> np.ndarray:
        ids = np.arange(self.vocab_size, dtype=np.int64)
        if self.special_ids:
            ids = ids[~np.isin(ids, np.fromiter(self.special_ids, dtype=np.int64))]
        if ids.size == 0:
            raise ValueError("the vocabulary has no ordinary (non-special) token ids")
        return ids


def load_token_space(tokenizer_path: str) -> TokenSpace:
    """Vocabulary size and special ids of a Hugging Face model/tokenizer directory (or of
    a GGUF file: its cached Hugging Face view, `gguf_loader.hf_view`).

    Reads tokenizer.json with `tokenizers` (fast); falls back to transformers'
    AutoTokenizer when there is none. The size is capped by config.json's `vocab_size`
    when present, so every id is also a valid embedding row.
    """
    from tandem.model_executor.gguf_loader import hf_view

    tokenizer_path = hf_view(tokenizer_path)
    specials: set[int] = set()
    tok_json = os.path.join(tokenizer_path, "tokenizer.json")
    if os.path.isfile(tok_json):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(tok_json)
        vocab = tok.get_vocab_size(with_added_tokens=True)
        with open(tok_json) as f:
            specials |= {int(t["id"]) for t in json.load(f).get("added_tokens", []) if t.get("special")}
    else:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_path)
        vocab = len(tok)
        specials |= set(int(i) for i in tok.all_special_ids)
    cfg_path = os.path.join(tokenizer_path, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        with open(cfg_path) as f:
            decoder = json.load(f).get("added_tokens_decoder") or {}
        specials |= {int(i) for i, t in decoder.items() if isinstance(t, dict) and t.get("special")}
    model_cfg = os.path.join(tokenizer_path, "config.json")
    if os.path.isfile(model_cfg):
        with open(model_cfg) as f:
            model_vocab = json.load(f).get("vocab_size")
        if isinstance(model_vocab, int) and model_vocab > 0:
            vocab = min(vocab, model_vocab)
    return TokenSpace(vocab_size=vocab, special_ids=frozenset(i for i in specials if i < vocab))


def sample_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """`n` lengths uniform in [max(1, int(range_ratio * length)), length] (inclusive)."""
    if length < 1:
        raise ValueError(f"length must be at least 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    low = max(1, int(range_ratio * length))
    return rng.integers(low, length + 1, size=n)


def _draw_ids(rng: np.random.Generator, allowed: np.ndarray, n: int) -> list[int]:
    return allowed[rng.integers(0, allowed.size, size=n)].tolist()


def generate_random_requests(
    num_prompts: int, input_len: int, output_len: int, range_ratio: float, space: TokenSpace, seed: int = 1
) -> list[BenchRequest]:
    """The `random` workload (see the module docstring)."""
    rng = np.random.default_rng(seed)
    allowed = space.allowed_ids()
    in_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    out_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    return [BenchRequest(_draw_ids(rng, allowed, int(n_in)), int(n_out)) for n_in, n_out in zip(in_lens, out_lens)]


def generate_shared_prefix_requests(
    num_groups: int,
    prompts_per_group: int,
    system_prompt_len: int,
    question_len: int,
    output_len: int,
    space: TokenSpace,
    seed: int = 1,
) -> list[BenchRequest]:
    """The `shared-prefix` workload (see the module docstring)."""
    if num_groups < 1 or prompts_per_group < 1 or question_len < 1 or output_len < 1 or system_prompt_len < 0:
        raise ValueError("shared-prefix: groups, prompts per group, question and output lengths must be >= 1")
    rng = np.random.default_rng(seed)
    allowed = space.allowed_ids()
    reqs = []
    for _ in range(num_groups):
        prefix = _draw_ids(rng, allowed, system_prompt_len)
        for _ in range(prompts_per_group):
            reqs.append(BenchRequest(prefix + _draw_ids(rng, allowed, question_len), output_len))
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def arrival_offsets(n: int, request_rate: float, seed: int = 1) -> list[float]:
    """Send time of each request in seconds after the start: a Poisson process of
    `request_rate` requests/s (exponential gaps; the first request at 0), or all at 0
    when the rate is infinite."""
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    if request_rate <= 0:
        raise ValueError(f"request rate must be positive, got {request_rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()
