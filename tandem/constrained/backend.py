"""What every grammar backend shares (`--grammar-backend xgrammar|llguidance|outlines`):
grammars compile on a thread pool into a cache keyed by `GrammarKey`, so that a batch
never waits for a compile (the request waits in the scheduler's `GrammarQueue`); one
matcher (`Grammar`) per request; a batch's allowed tokens filled into a `VocabMask`.

The cache holds the futures, so a grammar compiles once however many requests (or
samples of `n > 1`) use it; a grammar that failed stays failed. A backend subclass
gives `_load(tokenizer)` (its library's view of the vocabulary), `_compile(key)` (raises
ValueError naming the field), `make_grammar(compiled)`, and, where its library has a
batched fill, `_fill_rows`.

All three write the same bitmask (int32 words, bit set: allowed; xgrammar's layout,
which llguidance and outlines-core share), so `VocabMask` is one for all.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from tandem.constrained.grammar_key import GrammarKey
from tandem.constrained.vocab_mask import VocabMask

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 1024
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "outlines", "none")


class Grammar(Protocol):
    """One request's matcher. It has accepted exactly the request's processed
    `output_ids` (a retracted request keeps it as is: it resumes with the same outputs)."""

    def accept_token(self, token_id: int) -> None:
        """Advance by one sampled token; RuntimeError when the grammar rejects it."""

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into `bitmask[row]`."""


class GrammarBackend:
    name = ""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = True,
    ):
        """`vocab_size`: the model's (the logits' width), which may exceed the tokenizer's
        (padded vocabularies): the ids past the tokenizer's are never allowed."""
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.stop_token_ids = sorted(stop_token_ids)
        self.any_whitespace = any_whitespace
        self._load(tokenizer)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        # Its thread started now, not at the first grammar: started by a bound forward thread
        # it would share that thread's CPU (tandem/utils/cpu_threads.py, "Placement").
        self._pool.submit(int).result()
        self._cache: collections.OrderedDict[GrammarKey, Future] = collections.OrderedDict()

    def compile(self, key: GrammarKey) -> Future:
        """The compiled grammar of `key`, from the cache or compiled in the background.
        The future's exception is a ValueError naming the problem."""
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, key)
            self._cache[key] = future
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return future

    def _load(self, tokenizer) -> None:
        raise NotImplementedError

    def _compile(self, key: GrammarKey) -> Any:
        raise NotImplementedError

    def make_grammar(self, compiled: Any) -> Grammar:
        raise NotImplementedError

    def fill_vocab_mask(self, mask: VocabMask, grammars: list[Grammar | None]) -> None:
        """Fill the rows of `mask` whose request has a grammar (the others allow every
        token) and mark it ready for the sampler."""
        try:
            rows = [i for i, g in enumerate(grammars) if g is not None]
            if rows:
                self._fill_rows(mask.bitmask, grammars, rows)
            mask.rows = rows
        finally:
            mask.set_ready()  # never leave the sampler waiting, even on an error

    def _fill_rows(self, bitmask: torch.Tensor, grammars: list, rows: list[int]) -> None:
        for i in rows:
            grammars[i].fill_row(bitmask, i)


def create_grammar_backend(
    name: str, tokenizer, vocab_size: int, stop_token_ids: list[int], any_whitespace: bool = True
) -> GrammarBackend | None:
    """The scheduler's backend for `--grammar-backend name` (None: none, or no tokenizer).
    Each library is imported only when chosen."""
    if name == "none" or tokenizer is None:
        return None
    if name == "xgrammar":
        from tandem.constrained.xgrammar_backend import XGrammarBackend as backend
    elif name == "llguidance":
        from tandem.constrained.llguidance_backend import LLGuidanceBackend as backend
    elif name == "outlines":
        from tandem.constrained.outlines_backend import OutlinesBackend as backend
    else:
        raise ValueError(f"--grammar-backend: unknown backend {name!r} (one of {', '.join(GRAMMAR_BACKENDS)})")
    return backend(tokenizer, vocab_size, stop_token_ids, any_whitespace=any_whitespace)
