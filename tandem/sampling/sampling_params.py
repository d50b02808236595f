"""Sampling parameters of one request, validated where they enter the server.

`SamplingParams` uses SGLang's field names. `verify()` raises `ValueError` whose message
names the offending field, which the HTTP layer turns into a 400. The penalties and
`min_new_tokens` are applied by `tandem.sampling.penalties`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

# Below this temperature sampling is greedy (argmax); SGLang uses the same cut.
GREEDY_TEMPERATURE_EPS = 1e-6


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
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

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> "SamplingParams":
        """Build from a request's `sampling_params` object; unknown keys are an error."""
        data = dict(data or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"sampling_params.{unknown[0]}: unknown sampling parameter")
        # JSON null means "default".
        data = {k: v for k, v in data.items() if v is not None or k == "sampling_seed"}
        if isinstance(data.get("stop"), str):
            data["stop"] = [data["stop"]]
        if isinstance(data.get("stop_token_ids"), int) and not isinstance(data.get("stop_token_ids"), bool):
            data["stop_token_ids"] = [data["stop_token_ids"]]
        params = cls(**data)
        params.verify()
        return params

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the field when a value has the wrong type or range."""
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
        if not isinstance(self.stop_token_ids, list):
            raise ValueError("sampling_params.stop_token_ids: must be a list of token ids")
        for tid in self.stop_token_ids:
            _check_int("stop_token_ids", tid, lo=0)
            if vocab_size is not None and tid >= vocab_size:
                raise ValueError(f"sampling_params.stop_token_ids: id {tid} is outside the vocabulary of size {vocab_size}")
        for name in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sampling_params.{name}: must be a boolean")
        if self.sampling_seed is not None:
            _check_int("sampling_seed", self.sampling_seed)
        _check_int("n", self.n, lo=1)
        for name in ("frequency_penalty", "presence_penalty"):
            _check_number(name, getattr(self, name))
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"sampling_params.{name}: must be in [-2, 2], got {getattr(self, name)}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise ValueError(f"sampling_params.repetition_penalty: must be in (0, 2], got {self.repetition_penalty}")
        _check_int("min_new_tokens", self.min_new_tokens, lo=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(f"sampling_params.min_new_tokens: must be <= max_new_tokens ({self.max_new_tokens}), "
                             f"got {self.min_new_tokens}")


def _check_int(name: str, value: Any, lo: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"sampling_params.{name}: must be an integer, got {value!r}")
    if lo is not None and value < lo:
        raise ValueError(f"sampling_params.{name}: must be >= {lo}, got {value}")


def _check_number(name: str, value: Any, lo: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"sampling_params.{name}: must be a number, got {value!r}")
    if value != value:  # NaN
        raise ValueError(f"sampling_params.{name}: must not be NaN")
    if lo is not None and value < lo:
        raise ValueError(f"sampling_params.{name}: must be >= {lo}, got {value}")
