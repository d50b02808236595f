"""The grammar backend on llguidance (`--grammar-backend llguidance`): `json_schema`
(llguidance's JSON compiler), `regex`, `ebnf` (GBNF, as xgrammar reads it, converted to
Lark by llguidance), `structural_tag` in its legacy shape (llguidance's `StructTag`; the
`format` shape is xgrammar's, a 400 here). A grammar compiles once into a matcher that each request copies;
a batch's rows are filled in one parallel call (`fill_next_token_bitmask_par`)."""

from __future__ import annotations

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from tandem.constrained import structural_tag
from tandem.constrained.backend import GrammarBackend
from tandem.constrained.grammar_key import GrammarKey, one_line

_FORMATS = {"json_schema": "json_schema", "regex": "regex", "ebnf": "ebnf"}


def llguidance_structural_tag(value: str) -> str:
    """The Lark grammar of a legacy structural tag: each structure's trigger is the first
    trigger its `begin` starts with (llguidance's StructTag needs one per structure)."""
    tag = structural_tag.load(value)
    if not structural_tag.is_legacy(tag) or tag.get("at_least_one"):
        what = "at_least_one" if structural_tag.is_legacy(tag) else "'format' (only the legacy structures and triggers)"
        raise structural_tag.StructuralTagError(
            f"{structural_tag.FIELD}: the llguidance grammar backend (--grammar-backend llguidance) has no "
            f"structural tag {what}; use --grammar-backend xgrammar"
        )
    structures, triggers = structural_tag.legacy_parts(tag)
    tags = []
    for i, s in enumerate(structures):
        trigger = next((t for t in triggers if s["begin"].startswith(t)), None)
        if trigger is None:
            raise structural_tag.StructuralTagError(
                f"{structural_tag.FIELD}: invalid structural_tag: structures[{i}].begin starts with no trigger"
            )
        tags.append(llguidance.StructTag(trigger=trigger, begin=s["begin"], grammar=s["schema"], end=s["end"]))
    return llguidance.StructTag.to_grammar(tags)


def llguidance_grammar(key: GrammarKey, any_whitespace: bool = True) -> str:
    """The llguidance grammar of `key`, unchecked; ValueError naming the field when it
    does not even parse as its kind (a JSON schema that is not JSON, ...)."""
    kind, value = key
    try:
        if kind == "json_schema":
            options = None if any_whitespace else {"whitespace_flexible": False}
            return llguidance.LLMatcher.grammar_from_json_schema(value, defaults=options)
        if kind == "structural_tag":
            return llguidance_structural_tag(value)
        return llguidance.grammar_from(_FORMATS[kind], value)
    except structural_tag.StructuralTagError:
        raise
    except (ValueError, RuntimeError, TypeError) as e:
        raise ValueError(f"sampling_params.{kind}: invalid {kind}: {one_line(str(e))}") from e


def check_llguidance_grammar(key: GrammarKey, any_whitespace: bool = True, tokenizer=None) -> str:
    """The grammar of `key` checked (with `tokenizer`, against its vocabulary too);
    ValueError naming the field and the problem."""
    grammar = llguidance_grammar(key, any_whitespace)
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        kind = key[0]
        raise ValueError(f"sampling_params.{kind}: invalid {kind}: {one_line(error)}")
    return grammar


class LLGuidanceGrammar:
    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]):
        self.matcher = matcher
        self._stop = stop_token_ids
        self._terminated = False

    def accept_token(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise RuntimeError(f"the grammar rejected token {token_id}: {self.matcher.get_error()}")
        if token_id in self._stop:
            self._terminated = True

    def is_terminated(self) -> bool:
        return self._terminated

    def fill_row(self, bitmask: torch.Tensor, row: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self.matcher, bitmask, row)


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def _load(self, tokenizer) -> None:
        self._stop = frozenset(self.stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token=self.stop_token_ids
        )
        self._executor = llguidance.LLExecutor(num_threads=1)

    def _compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        grammar = check_llguidance_grammar(key, self.any_whitespace, self._tokenizer)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            kind = key[0]
            raise ValueError(f"sampling_params.{kind}: invalid {kind}: {one_line(matcher.get_error())}")
        return matcher

    def make_grammar(self, compiled: llguidance.LLMatcher) -> LLGuidanceGrammar:
        return LLGuidanceGrammar(compiled.deep_copy(), self._stop)

    def _fill_rows(self, bitmask: torch.Tensor, grammars: list, rows: list[int]) -> None:
        llguidance.torch.fill_next_token_bitmask_par(self._executor, [(grammars[i].matcher, i) for i in rows], bitmask)
