"""The scheduler's grammar backend on xgrammar: compiles grammars on a thread pool into
a cache keyed by `GrammarKey`, makes one matcher per request, and fills a batch's mask.

Compiling takes milliseconds for a typical JSON schema on the tiny vocabularies and more
for large ones; it runs on `compile_threads` background threads so that a batch never
waits for it (the request waits in the scheduler's `GrammarQueue` instead). The cache
holds the futures, so a grammar compiles once however many requests (or samples of
`n > 1`) use it; a grammar that failed stays failed.
"""

from __future__ import annotations

import collections
import logging
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar

from tandem.constrained.grammar_key import GrammarKey, parse_grammar
from tandem.constrained.vocab_mask import VocabMask

logger = logging.getLogger(__name__)

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 1024


class Grammar:
    """One request's matcher: which tokens may come next, advanced by each output token.
    It has accepted exactly the request's processed `output_ids` (a retracted request
    keeps it as is: it resumes with the same outputs)."""

    def __init__(self, compiled: xgrammar.CompiledGrammar):
        self.matcher = xgrammar.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.accept_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}")

    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""
        return self.matcher.is_terminated()


class XGrammarBackend:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = True,
        compile_threads: int = 1,
    ):
        """`vocab_size`: the model's (the logits' width), which may exceed the tokenizer's
        (padded vocabularies): the ids past the tokenizer's are never allowed."""
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=max(vocab_size, len(tokenizer)), stop_token_ids=sorted(stop_token_ids)
        )
        self.vocab_size = info.vocab_size
        self.any_whitespace = any_whitespace
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(compile_threads, thread_name_prefix="grammar-compile")
        self._cache: collections.OrderedDict[GrammarKey, Future] = collections.OrderedDict()
        self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=1)

    def compile(self, key: GrammarKey) -> Future[xgrammar.CompiledGrammar]:
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

    def _compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        return self._compiler.compile_grammar(parse_grammar(key, self.any_whitespace))

    def fill_vocab_mask(self, mask: VocabMask, grammars: list[Grammar | None]) -> None:
        """Fill the rows of `mask` whose request has a grammar (the others allow every
        token), in one batched call, and mark it ready for the sampler."""
        try:
            rows = [i for i, g in enumerate(grammars) if g is not None]
            if rows:
                self._batch_matcher.batch_fill_next_token_bitmask(
                    [grammars[i].matcher for i in rows], mask.bitmask, rows
                )
            mask.rows = rows
        finally:
            mask.set_ready()  # never leave the sampler waiting, even on an error
