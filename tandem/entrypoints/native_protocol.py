"""The native request schema: a `/generate` request (or `Engine.generate` call) before
tokenization, and its validation (SGLang's `GenerateReqInput`). It never crosses a process
boundary: the tokenizer side turns it into `messages.TokenizedGenerateReqInput`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from tandem.sampling.sampling_params import is_neutral

# Longest client rid: it is echoed in every output (each streamed chunk included).
MAX_RID_LENGTH = 512


@dataclass
class GenerateReqInput:
    """A native `/generate` request (or `Engine.generate` call), before tokenization.

    Exactly one of `text` and `input_ids` is given; each may be one prompt or a batch
    (a list of strings / a list of id lists). `sampling_params`, `rid` and the three
    logprob fields may be one value for all prompts or a list with one per prompt;
    `token_ids_logprob` one list of ids for all prompts or a list of such lists.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] = False
    # Input positions from which input logprobs are returned (-1: none, only outputs).
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    # With return_logprob: token ids whose logprobs are returned at every position
    # (SGLang's field; meta_info's input_/output_token_ids_logprobs). Empty means none.
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    # SGLang's priority (--enable-priority-scheduling orders and preempts by it; ignored
    # otherwise): one integer for the whole request.
    priority: int | None = None
    # SGLang's serialized custom logit processor (CustomLogitProcessor.to_str()), one for
    # all prompts or one per prompt; only with --enable-custom-logit-processor.
    custom_logit_processor: str | list[str | None] | None = None
    # The LoRA adapter (its name; --enable-lora), one for all prompts or one per prompt
    # (null: the base model).
    lora_path: str | list[str | None] | None = None

    @classmethod
    def from_json(cls, data: Any) -> GenerateReqInput:
        """Parse a JSON body; raises ValueError naming the offending field.

        As in SGLang, unknown top-level fields are ignored and null means the default.
        A field of SGLang's request whose feature Tandem lacks (UNSUPPORTED_GENERATE_FIELDS)
        is a ValueError naming the feature unless it holds its neutral value.
        """
        if not isinstance(data, dict):
            raise ValueError("request body: must be a JSON object")
        for name, feature in UNSUPPORTED_GENERATE_FIELDS.items():
            value = data.get(name)
            values = value if isinstance(value, list) and name in _PER_PROMPT_FLAGS else [value]
            if not all(is_neutral(v, _NEUTRAL_GENERATE_VALUES.get(name)) for v in values):
                raise ValueError(f"{name}: {feature} is not supported yet")
        known = {f for f in cls.__dataclass_fields__}
        obj = cls(**{k: v for k, v in data.items() if k in known and v is not None})
        obj.validate_shape()
        return obj

    def validate_shape(self) -> None:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text/input_ids: exactly one of them must be given")
        if self.text is not None:
            if isinstance(self.text, list):
                if not self.text or not all(isinstance(t, str) for t in self.text):
                    raise ValueError("text: must be a string or a non-empty list of strings")
            elif not isinstance(self.text, str):
                raise ValueError("text: must be a string or a list of strings")
        else:
            ids = self.input_ids
            if not isinstance(ids, list) or not ids:
                raise ValueError("input_ids: must be a non-empty list of token ids or of lists")
            rows = ids if isinstance(ids[0], list) else [ids]
            for row in rows:
                if (
                    not isinstance(row, list)
                    or not row
                    or not all(isinstance(t, int) and not isinstance(t, bool) for t in row)
                ):
                    raise ValueError("input_ids: every prompt must be a non-empty list of integers")
        for name in ("stream", "return_text_in_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: must be a boolean")
        if self.priority is not None and (
            isinstance(self.priority, bool) or not isinstance(self.priority, int) or abs(self.priority) >= 2**63
        ):
            raise ValueError("priority: must be an integer")
        for value in _as_list(self.return_logprob):
            if not isinstance(value, bool):
                raise ValueError("return_logprob: must be a boolean")
        for name, lo in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
            for value in _as_list(getattr(self, name)):
                if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                    raise ValueError(f"{name}: must be an integer >= {lo}")
        n = self.batch_size
        self._validate_token_ids_logprob(n)
        for name in ("sampling_params", "rid", "custom_logit_processor", "lora_path", *_PER_PROMPT_LOGPROB_FIELDS):
            value = getattr(self, name)
            if isinstance(value, list):
                if not self.is_batch or len(value) != n:
                    raise ValueError(f"{name}: a list must have one entry per prompt ({n})")
        if self.sampling_params is not None:
            for sp in self.sampling_params if isinstance(self.sampling_params, list) else [self.sampling_params]:
                if not isinstance(sp, dict):
                    raise ValueError("sampling_params: must be an object")
        for name in _as_list(self.lora_path):
            if name is not None and (not isinstance(name, str) or not name):
                raise ValueError("lora_path: must be an adapter name (a non-empty string), a list of them, or null")
        if self.rid is not None:
            for rid in self.rid if isinstance(self.rid, list) else [self.rid]:
                if not isinstance(rid, str) or not rid:
                    raise ValueError("rid: must be a non-empty string")
                if len(rid) > MAX_RID_LENGTH:
                    raise ValueError(f"rid: must be at most {MAX_RID_LENGTH} characters, got {len(rid)}")

    def _validate_token_ids_logprob(self, n: int) -> None:
        """A list of ids, or (a batch) one list per prompt; an empty list means none."""
        value = self.token_ids_logprob
        if not value:
            self.token_ids_logprob = None
            return
        nested = isinstance(value, list) and isinstance(value[0], list)
        rows = value if nested else [value]
        if not isinstance(value, list) or not all(
            isinstance(row, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in row) for row in rows
        ):
            raise ValueError(
                "token_ids_logprob: must be a flat list of integers (token ids), or one such list per prompt"
            )
        if nested and not self.is_batch:  # SGLang's words
            raise ValueError(
                "token_ids_logprob: must be a flat list of integers for a single prompt "
                "(a list of lists gives one list per prompt of a batch)"
            )
        if nested and len(value) != n:
            raise ValueError(f"token_ids_logprob: a list of lists must have one list per prompt ({n})")

    @property
    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return isinstance(self.input_ids[0], list)

    @property
    def batch_size(self) -> int:
        if not self.is_batch:
            return 1
        return len(self.text) if self.text is not None else len(self.input_ids)

    def item(self, i: int) -> GenerateReqInput:
        """The i-th prompt of a batch as a single request."""

        def pick(value):
            return value[i] if isinstance(value, list) else value

        return dataclasses.replace(
            self,
            text=self.text[i] if self.text is not None else None,
            input_ids=self.input_ids[i] if self.input_ids is not None else None,
            sampling_params=pick(self.sampling_params),
            rid=pick(self.rid),
            custom_logit_processor=pick(self.custom_logit_processor),
            lora_path=pick(self.lora_path),
            token_ids_logprob=self.token_ids_for(i),
            **{name: pick(getattr(self, name)) for name in _PER_PROMPT_LOGPROB_FIELDS},
        )

    def token_ids_for(self, i: int) -> list[int] | None:
        """The `token_ids_logprob` of prompt i (a flat list applies to every prompt)."""
        value = self.token_ids_logprob
        if value and isinstance(value[0], list):
            return value[i] or None
        return value or None


def _as_list(value: Any) -> list:
    return value if isinstance(value, list) else [value]


# Logprob fields that, as in SGLang, may hold one value per prompt of a batch.
_PER_PROMPT_LOGPROB_FIELDS = ("return_logprob", "logprob_start_len", "top_logprobs_num")
# Fields of SGLang's GenerateReqInput whose feature Tandem lacks -> the feature, for the
# 400 message. Null, false, an empty value or 0 is accepted and ignored. Other fields
# SGLang knows (labels and hints such as session_id, priority, custom_labels, log_metrics)
# and unknown fields are ignored, as SGLang ignores unknown fields.
UNSUPPORTED_GENERATE_FIELDS = MappingProxyType(
    {
        "input_embeds": "input embedding",
        "image_data": "image input",
        "video_data": "video input",
        "audio_data": "audio input",
        "return_hidden_states": "returning hidden states",
        "return_routed_experts": "returning routed experts",
        "return_entropy": "returning entropy",
        "return_sampling_mask": "returning the sampling mask",
        "return_flat_raw_top_logprobs": "flat top-logprob output",
        "return_flat_raw_output_top_logprobs": "flat top-logprob output",
        "return_prompt_token_ids": "returning prompt token ids",
        "lora_id": "LoRA by internal id",
        "session_params": "session",
        "bootstrap_host": "prefill-decode disaggregation",
        "bootstrap_room": "prefill-decode disaggregation",
        "data_parallel_rank": "data parallelism",
        "routed_dp_rank": "data parallelism",
        "positional_embed_overrides": "embedding override",
        "cache_salt": "cache salt",
        "max_thinking_tokens": "a thinking budget",
        "require_reasoning": "reasoning control",
        "background": "background mode",
    }
)
# Neutral values besides null, false and empty ones: one data-parallel rank, rank 0.
_NEUTRAL_GENERATE_VALUES = MappingProxyType({"data_parallel_rank": 0, "routed_dp_rank": 0})
# Unsupported fields that may hold one flag per prompt (each must be neutral).
_PER_PROMPT_FLAGS = frozenset(
    {
        "lora_id",
        "return_hidden_states",
        "return_sampling_mask",
        "bootstrap_host",
        "bootstrap_room",
    }
)
