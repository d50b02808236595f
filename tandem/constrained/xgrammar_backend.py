"""The grammar backend on xgrammar (`--grammar-backend xgrammar`, the default):
`json_schema`, `regex`, `ebnf`, compiled against the vocabulary on the shared compile
pool (tandem/constrained/backend.py); a batch's rows filled in one batched call.

Compiling takes milliseconds for a typical JSON schema on the tiny vocabularies and more
for large ones.
"""

from __future__ import annotations

import logging

import torch
import xgrammar

from tandem.constrained.backend import CACHE_SIZE, GrammarBackend
from tandem.constrained.grammar_key import GrammarKey, parse_grammar

logger = logging.getLogger(__name__)
__all__ = ["CACHE_SIZE", "Grammar", "XGrammarBackend"]


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

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def _load(self, tokenizer) -> None:
        info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._batch_matcher = xgrammar.BatchGrammarMatcher(max_threads=1)

    def _compile(self, key: GrammarKey) -> xgrammar.CompiledGrammar:
        return self._compiler.compile_grammar(parse_grammar(key, self.any_whitespace))

    def make_grammar(self, compiled: xgrammar.CompiledGrammar) -> Grammar:
        return Grammar(compiled)

    def _fill_rows(self, bitmask: torch.Tensor, grammars: list, rows: list[int]) -> None:
        self._batch_matcher.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], bitmask, rows)
