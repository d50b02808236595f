"""The grammar backend on outlines (`--grammar-backend outlines`): outlines-core, the
regex automaton that the `outlines` package runs on. `regex`, and `json_schema` through
outlines' JSON-schema-to-regex; no `ebnf` or `structural_tag` (outlines builds no
context-free grammars), and
no numeric bounds in a schema (`minimum`, `maximum`, ...: outlines' regex ignores them,
so its outputs would break them): a request with either is a 400 naming the backend. A
grammar compiles into an `Index` (the automaton over the vocabulary) that each request
walks with its own `Guide`.

The vocabulary is the tokenizer's tokens as bytes (xgrammar's decoding of the
tokenizer, which knows byte-level and SentencePiece byte-fallback tokens), so a token
that is part of a UTF-8 character is allowed exactly where its bytes fit; special and
stop tokens are left out, and the stop tokens are allowed wherever the automaton may end.
"""

from __future__ import annotations

import functools
import json

import outlines_core
import torch
import xgrammar
from outlines_core.json_schema import build_regex_from_schema

from tandem.constrained.backend import GrammarBackend
from tandem.constrained.grammar_key import GrammarKey, one_line


def _unsupported(kind: str) -> ValueError:
    return ValueError(
        f"sampling_params.{kind}: the outlines grammar backend (--grammar-backend outlines) has no {kind}; "
        "use --grammar-backend xgrammar or llguidance"
    )


# Schema keywords outlines' JSON-schema-to-regex does not honour.
_UNHONOURED = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
# Keywords whose values are data or maps of names to schemas, not schemas.
_DATA = ("enum", "const", "default", "examples")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def _unhonoured_keyword(node) -> str | None:
    if isinstance(node, list):
        return next((k for k in map(_unhonoured_keyword, node) if k), None)
    if not isinstance(node, dict):
        return None
    for name, value in node.items():
        if name in _UNHONOURED:
            return name
        if name in _DATA:
            continue
        if name in _SCHEMA_MAPS and isinstance(value, dict):
            found = _unhonoured_keyword(list(value.values()))
        else:
            found = _unhonoured_keyword(value)
        if found:
            return found
    return None


def outlines_regex(key: GrammarKey, any_whitespace: bool = True) -> str:
    """The regex of `key`; ValueError naming the field for a bad schema or another kind."""
    kind, value = key
    if kind == "regex":
        return value
    if kind != "json_schema":
        raise _unsupported(kind)
    try:
        regex = build_regex_from_schema(value, None if any_whitespace else "")
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"sampling_params.{kind}: invalid {kind}: {one_line(str(e))}") from e
    keyword = _unhonoured_keyword(json.loads(value))
    if keyword is not None:
        raise ValueError(
            f"sampling_params.{kind}: the outlines grammar backend (--grammar-backend outlines) does not honour "
            f"'{keyword}' in a JSON schema; use --grammar-backend xgrammar or llguidance"
        )
    return regex


@functools.cache
def _byte_vocabulary() -> outlines_core.Vocabulary:
    """Every single byte as a token: any regex that matches some text can be built from it."""
    return outlines_core.Vocabulary(256, {bytes([b]): [b] for b in range(256)})


def _index(key: GrammarKey, regex: str, vocabulary: outlines_core.Vocabulary) -> outlines_core.Index:
    try:
        return outlines_core.Index(regex, vocabulary)
    except (ValueError, TypeError, RuntimeError) as e:
        kind = key[0]
        raise ValueError(f"sampling_params.{kind}: invalid {kind}: {one_line(str(e))}") from e


def check_outlines_grammar(key: GrammarKey, any_whitespace: bool = True) -> None:
    """The tokenizer manager's check: ValueError naming the field and the problem."""
    regex = outlines_regex(key, any_whitespace)
    if key[0] == "regex":
        _index(key, regex, _byte_vocabulary())


class OutlinesGrammar:
    def __init__(self, index: outlines_core.Index, stop_token_ids: frozenset[int], stop_words: list[tuple[int, int]]):
        self.guide = outlines_core.Guide(index)
        self._stop = stop_token_ids
        self._stop_words = stop_words  # (word, bit) pairs of the stop tokens
        self._terminated = False

    def accept_token(self, token_id: int) -> None:
        if token_id in self._stop:
            if not self.guide.is_finished():
                raise RuntimeError(f"the grammar rejected stop token {token_id}: the output is incomplete")
            self._terminated = True
            return
        try:
            self.guide.advance(token_id)
        except ValueError as e:
            raise RuntimeError(f"the grammar rejected token {token_id}: {e}") from e

    def is_terminated(self) -> bool:
        return self._terminated

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        v.zero_()
        if self._terminated:
            return
        self.guide.write_mask_into(v.data_ptr(), v.numel(), v.element_size())
        if self.guide.is_finished():  # the output may end here: with any stop token
            for word, bit in self._stop_words:
                v[word] |= bit


class OutlinesBackend(GrammarBackend):
    name = "outlines"

    def _load(self, tokenizer) -> None:
        stop = self.stop_token_ids
        self._stop = frozenset(stop)
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size, stop_token_ids=stop)
        skip = self._stop | set(info.special_token_ids)
        tokens: dict[bytes, list[int]] = {}
        for token_id, text in enumerate(info.decoded_vocab):
            if text and token_id not in skip:
                tokens.setdefault(bytes(text), []).append(token_id)
        self._vocabulary = outlines_core.Vocabulary(stop[0], tokens)
        # (word, bit) of each stop token; bit 31 of an int32 word is its sign bit.
        self._stop_words = [(t // 32, (1 << (t % 32)) - (1 << 32 if t % 32 == 31 else 0)) for t in stop]

    def _compile(self, key: GrammarKey) -> outlines_core.Index:
        return _index(key, outlines_regex(key, self.any_whitespace), self._vocabulary)

    def make_grammar(self, compiled: outlines_core.Index) -> OutlinesGrammar:
        return OutlinesGrammar(compiled, self._stop, self._stop_words)
