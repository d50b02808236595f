"""What a request constrains its output to, and the check the TokenizerManager runs
before sending it (in the server's `--grammar-backend`): a grammar that does not parse
is a 400 naming the problem.

A `GrammarKey` is `(kind, value)`: kind is one of GRAMMAR_KINDS (SGLang's sampling
parameter names), value the string the client sent. The scheduler's compile cache is
keyed by it.
"""

from __future__ import annotations

import re

import xgrammar

from tandem.constrained.structural_tag import StructuralTagError, xgrammar_structural_tag

GrammarKey = tuple[str, str]
GRAMMAR_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# xgrammar prefixes its errors with a time and a C++ source location; clients need neither.
_NOISE = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?|^Invalid (structural tag|JSON) error: ")


def one_line(message: str) -> str:
    return " ".join(message.split())


def xgrammar_error(exc: Exception) -> str:
    """The message of an xgrammar error without its C++ prefix, on one line."""
    return one_line(_NOISE.sub("", str(exc)))


def parse_grammar(key: GrammarKey, any_whitespace: bool = True) -> xgrammar.Grammar:
    """Parse (not compile) the grammar of `key`; ValueError naming the field and the problem."""
    kind, value = key
    try:
        if kind == "json_schema":
            return xgrammar.Grammar.from_json_schema(value, any_whitespace=any_whitespace)
        if kind == "regex":
            return xgrammar.Grammar.from_regex(value)
        if kind == "structural_tag":
            return xgrammar.Grammar.from_structural_tag(xgrammar_structural_tag(value))
        return xgrammar.Grammar.from_ebnf(value)
    except StructuralTagError:
        raise
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"sampling_params.{kind}: invalid {kind}: {xgrammar_error(e)}") from e


def verify_grammar(key: GrammarKey, grammar_backend: str, has_tokenizer: bool, any_whitespace: bool) -> None:
    """The TokenizerManager's check of a constrained request, before anything is sent:
    ValueError (a 400) naming the field when this server cannot constrain it (the
    backend lacks the kind: named) or the grammar does not parse, in the backend's own
    parser. The scheduler compiles it again against the vocabulary."""
    kind = key[0]
    if grammar_backend == "none":
        raise ValueError(
            f"sampling_params.{kind}: structured output is disabled on this server (--grammar-backend none)"
        )
    if not has_tokenizer:
        raise ValueError(
            f"sampling_params.{kind}: structured output needs the tokenizer; this server runs "
            "with --skip-tokenizer-init"
        )
    if grammar_backend == "llguidance":
        from tandem.constrained.llguidance_backend import check_llguidance_grammar

        check_llguidance_grammar(key, any_whitespace)
    elif grammar_backend == "outlines":
        from tandem.constrained.outlines_backend import check_outlines_grammar

        check_outlines_grammar(key, any_whitespace)
    else:
        parse_grammar(key, any_whitespace)
