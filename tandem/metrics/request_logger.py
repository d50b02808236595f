"""--log-requests: one log line when a request arrives ("Receive: obj=...") and one when
it ends ("Finish: obj=..., out=..."), in SGLang's format. --log-requests-level, as in
SGLang: 0 metadata only; 1 also sampling parameters; 2 also inputs and outputs, each
string or list cut to 2048 characters/items (half from each end, joined by " ... ");
3 everything, uncut. Tandem's default is 2, so that a line stays bounded.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)

_INPUTS = frozenset({"text", "input_ids", "input_embeds", "image_data", "audio_data", "video_data", "lora_path"})
_OUTPUTS = frozenset({"text", "output_ids", "embedding"})
_UNCUT = 1 << 30
TRUNCATED_LENGTH = 2048


def truncated(data: Any, max_length: int, skip: frozenset[str] = frozenset()) -> str:
    """`data` (dataclass, dict, list, str, ...) as text, each string and list cut to
    `max_length` (its first and last halves), fields in `skip` left out."""
    if isinstance(data, str):
        if len(data) > max_length:
            half = max_length // 2
            return f"{data[:half]!r} ... {data[-half:]!r}"
        return repr(data)
    if isinstance(data, (list, tuple)):
        if len(data) > max_length:
            half = max_length // 2
            return f"{list(data[:half])} ... {list(data[-half:])}"
        return str(data)
    if isinstance(data, dict):
        parts = [f"'{k}': {truncated(v, max_length)}" for k, v in data.items() if k not in skip]
        return "{" + ", ".join(parts) + "}"
    if dataclasses.is_dataclass(data):
        parts = [
            f"{f.name}={truncated(getattr(data, f.name), max_length)}"
            for f in dataclasses.fields(data)
            if f.name not in skip
        ]
        return f"{type(data).__name__}(" + ", ".join(parts) + ")"
    return str(data)


class RequestLogger:
    """Logs requests and their outcomes at one --log-requests-level."""

    def __init__(self, level: int):
        self.max_length = TRUNCATED_LENGTH if level == 2 else _UNCUT
        self.skip: frozenset[str] = frozenset()
        self.out_skip: frozenset[str] = frozenset()
        if level <= 1:
            self.skip = _INPUTS | ({"sampling_params"} if level == 0 else frozenset())
            self.out_skip = _OUTPUTS

    def log_received(self, obj: Any) -> None:
        logger.info("Receive: obj=%s", truncated(obj, self.max_length, self.skip))

    def log_finished(self, obj: Any, out: dict[str, Any]) -> None:
        logger.info(
            "Finish: obj=%s, out=%s",
            truncated(obj, self.max_length, self.skip),
            truncated(out, self.max_length, self.out_skip),
        )
