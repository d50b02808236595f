"""Sampling parameters of one request, validated where they enter the server.

`SamplingParams` uses SGLang's field names. `verify()` raises `ValueError` whose message
names the offending field, which the HTTP layer turns into a 400. The penalties and
`min_new_tokens` are applied by `tandem.sampling.penalties`.
"""

from __future__ import annotations

import json
import math
import re
import reprlib
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

# Below this temperature sampling is greedy (argmax); SGLang uses the same cut.
GREEDY_TEMPERATURE_EPS = 1e-6
# Most samples one request may ask for (`n`, native and OpenAI).
MAX_N = 128
# Integer parameters must fit a signed 64-bit tensor element.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# SGLang sampling parameters of features Tandem does not have yet -> the feature, for the
# 400 message. Their neutral value (null, empty, beam_width 1) is accepted and ignored.
UNSUPPORTED_SAMPLING_PARAMS = MappingProxyType(
    {
        "choice": "structured output (choice)",
        "beam_width": "beam search",
        "logit_bias": "logit bias",
        "watermark": "watermarking",
        "stream_interval": "a per-request stream interval (use --stream-interval)",
    }
)
# Constrained decoding (tandem/constrained): at most one of these per request.
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
# Neutral values besides null and empty ones.
_NEUTRAL_SAMPLING_VALUES = MappingProxyType({"beam_width": 1})


def is_neutral(value: Any, neutral: Any = None) -> bool:
    """True for null, False, an empty string/list/object, or the field's own `neutral` value."""
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return neutral is not None and value == neutral and not isinstance(value, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    # Stop when the output's tail matches one of these regular expressions (Python `re`,
    # as SGLang); the finish reason names the pattern (tandem/scheduler/finish_check.py).
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    # Structured output: a JSON schema (a JSON string), a regular expression, an EBNF
    # grammar or a structural tag (JSON, tandem/constrained/structural_tag.py) the output
    # must match (tandem/constrained).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # Passed to the request's custom logit processor, one dict per row (SGLang's field;
    # ignored without a processor).
    custom_params: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Build from a request's `sampling_params` object.

        Every key of SGLang's sampling parameters is accepted; JSON null (and an empty
        string, list or object) means the default. A key whose feature Tandem lacks is a
        ValueError naming the feature unless it has its neutral value; a key SGLang does
        not know either is an error, as in SGLang.
        """
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - set(UNSUPPORTED_SAMPLING_PARAMS))
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: unknown sampling parameter")
        for name, feature in UNSUPPORTED_SAMPLING_PARAMS.items():
            if not is_neutral(data.pop(name, None), _NEUTRAL_SAMPLING_VALUES.get(name)):
                raise ValueError(f"sampling_params.{name}: {feature} is not supported yet")
        # JSON null means "default"; so does an empty grammar.
        data = {
            k: v
            for k, v in data.items()
            if (v is not None or k == "sampling_seed") and not (k in GRAMMAR_FIELDS and is_neutral(v))
        }
        for name in ("json_schema", "structural_tag"):  # given as an object, not a string
            if isinstance(data.get(name), dict):
                data[name] = json.dumps(data[name])
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        if isinstance(data.get("stop_regex"), str):
            data["stop_regex"] = [data["stop_regex"]] if data["stop_regex"] else []
        if isinstance(data.get("stop_token_ids"), int) and not isinstance(data.get("stop_token_ids"), bool):
            data["stop_token_ids"] = [data["stop_token_ids"]]
        params = cls(**data)
        params.verify()
        return params

    def grammar_key(self) -> tuple[str, str] | None:
        """(field, value) of the grammar the output must match (a compile-cache key), or None."""
        for name in GRAMMAR_FIELDS:
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def verify(self) -> None:
        """Raise ValueError naming the field when a value has the wrong type or range.

        Every value that reaches a tensor is bounded here: integers fit in 64 bits,
        floats are finite, `n` is at most MAX_N, token ids are not negative.
        """
        _check_int("max_new_tokens", self.max_new_tokens, lo=0)
        _check_number("temperature", self.temperature, lo=0.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"sampling_params.top_p: must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k)
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"sampling_params.top_k: must be -1 (disabled) or >= 1, got {self.top_k}")
        _check_number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"sampling_params.min_p: must be in [0, 1], got {self.min_p}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError("sampling_params.stop: must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            raise ValueError("sampling_params.stop: stop strings must not be empty")
        if not isinstance(self.stop_regex, list) or not all(isinstance(s, str) for s in self.stop_regex):
            raise ValueError("sampling_params.stop_regex: must be a string or a list of strings")
        for pattern in self.stop_regex:
            try:
                re.compile(pattern)
            except (re.error, RecursionError, OverflowError) as e:
                raise ValueError(f"sampling_params.stop_regex: invalid regex {_show(pattern)}: {e}") from None
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("sampling_params.stop_token_ids: must be a list of token ids")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, lo=0)
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name}: must be a boolean")
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed, lo=INT64_MIN)
        _check_int("n", self.n, lo=1, hi=MAX_N)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling_params.{name}: must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"sampling_params.repetition_penalty: must be in (0, 2], got {self.repetition_penalty}")
        _check_int("min_new_tokens", self.min_new_tokens, lo=0)
        grammars = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in grammars:
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"sampling_params.{name}: must be a string")
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            raise ValueError("sampling_params.custom_params: must be an object")
        if "structural_tag" in grammars and len(grammars) > 1:
            raise ValueError(
                f"sampling_params: structural_tag cannot be combined with {grammars[0]} (one grammar per request)"
            )
        if len(grammars) > 1:
            raise ValueError(
                f"sampling_params: only one of regex, json_schema, or ebnf can be set (got {' and '.join(grammars)})"
            )
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"sampling_params.min_new_tokens: must be <= max_new_tokens ({self.max_new_tokens}), "
                f"got {self.min_new_tokens}"
            )

    def normalize(self, vocab_size: int) -> None:
        """Clamp what is larger than the model can use: a top_k past the vocabulary means
        all of it; a stop token id past it can never be sampled and is dropped (SGLang
        accepts such ids too: its tests send Llama-3's ids to any model). (The scheduler
        caps max_new_tokens to the context.) Call after verify()."""
        if self.top_k > vocab_size:
            self.top_k = vocab_size
        self.stop_token_ids = [tid for tid in self.stop_token_ids if tid < vocab_size]


def _check_int(name: str, value: Any, lo: int = INT64_MIN, hi: int = INT64_MAX) -> None:
    """An integer in [lo, hi]; the default range is what fits a signed 64-bit tensor."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name}: must be an integer, got {_show(value)}")
    if value < lo:
        raise ValueError(f"sampling_params.{name}: must be >= {lo}, got {_show(value)}")
    if value > hi:
        raise ValueError(f"sampling_params.{name}: must be <= {hi}, got {_show(value)}")


def _check_number(name: str, value: Any, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{name}: must be a number, got {_show(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        finite = False
    if not finite:
        raise ValueError(f"sampling_params.{name}: must be a finite number, got {_show(value)}")
    if lo is not None and value < lo:
        raise ValueError(f"sampling_params.{name}: must be >= {lo}, got {value}")


def _show(value: Any) -> str:
    """A short repr of a client's value for an error message (never huge, never recursing)."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    return reprlib.repr(value)
