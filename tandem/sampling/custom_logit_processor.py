"""Custom logit processors: Python code that clients send with a request (SGLang's feature).

Only with `--enable-custom-logit-processor`: the server then runs whatever code a client
sends, with the server's rights (docs/api.md). The wire format is SGLang's, so
`CustomLogitProcessor.to_str()` from SGLang's own client works unchanged: a JSON object
`{"callable": "<hex>"}` whose hex string is `dill.dumps(cls)` of a processor class
(an instance is accepted too). A class is instantiated once per request, so a stateful
processor keeps its attributes from step to step, each request its own.

A processor is called as SGLang calls it, `processor(logits, custom_param_list)`, on the
rows of the requests that carry it (a [rows, vocab] float32 copy) and returns their new
logits. `custom_param_list` has one dict per row: the request's
`sampling_params.custom_params` plus `"__req__"`, a `ProcessorReq` with the fields SGLang's
examples read (`rid`, `origin_input_ids`, `output_ids`, `sampling_params`). The dict is the
same object at every step of a request, so what a processor writes into it stays (SGLang's
stateful examples count down a value there). Under the overlap loop `output_ids` includes
the token of the forward before (resolved on the compute side), so a processor sees the
same ids as without overlap. It runs after penalties and the grammar mask and before
temperature / top-k / top-p; reported logprobs stay those of the model (as for penalties).

Unpickling: a class defined inside a function is carried by value; its module's globals
are imported by name when that module exists here, else (a client's own script, its
`__main__`) they are a fresh namespace holding `torch` and this module's names. SGLang's
`sglang.srt.sampling.custom_logit_processor` module, which a client's class inherits from
by reference, is this module.
"""

from __future__ import annotations

import builtins
import io
import json
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

# The module SGLang's clients inherit their processors from; unpickled as this module.
SGLANG_MODULE = "sglang.srt.sampling.custom_logit_processor"
REQ_KEY = "__req__"
ENABLE_FLAG = "--enable-custom-logit-processor"


class CustomLogitProcessor(ABC):
    """SGLang's base class, with its serialized form (to_str / from_str)."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: list[dict[str, Any]] | None = None) -> torch.Tensor:
        """New logits for `logits` [rows, vocab], one params dict per row."""

    @classmethod
    def to_str(cls) -> str:
        import dill

        return json.dumps({"callable": dill.dumps(cls).hex()})

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        return deserialize(json_str)


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Masks the ids in each row's `token_ids` parameter (SGLang ships one of this name)."""

    def __call__(self, logits, custom_param_list=None):
        for row, params in enumerate(custom_param_list or []):
            ids = (params or {}).get("token_ids")
            if ids:
                logits[row, ids] = -float("inf")
        return logits


def check_format(value: Any) -> None:
    """Raise ValueError unless `value` has the serialized form (no code is run here)."""
    name = "custom_logit_processor"
    shape = f'{name}: must be a JSON object {{"callable": "<hex>"}} (CustomLogitProcessor.to_str())'
    if not isinstance(value, str):
        raise ValueError(f"{name}: must be a string (CustomLogitProcessor.to_str())")
    try:
        data = json.loads(value)
    except ValueError:
        raise ValueError(shape) from None
    if not isinstance(data, dict) or not isinstance(data.get("callable"), str):
        raise ValueError(shape)
    try:
        bytes.fromhex(data["callable"])
    except ValueError:
        raise ValueError(f"{name}: callable must be a hex string of dill-serialized bytes") from None


def _namespace() -> types.ModuleType:
    """The globals of a processor whose own module does not exist here."""
    ns = types.ModuleType("custom_logit_processor_client")
    ns.__dict__.update(
        {
            "__builtins__": builtins,
            "torch": torch,
            "CustomLogitProcessor": CustomLogitProcessor,
            "DisallowedTokensLogitsProcessor": DisallowedTokensLogitsProcessor,
        }
    )
    return ns


def _unpickler_class():
    import dill

    class _Unpickler(dill.Unpickler):
        def find_class(self, module: str, name: str):
            if module == SGLANG_MODULE or module.startswith(SGLANG_MODULE + "."):
                if name == "__dict__":
                    return globals()
                if name in globals():
                    return globals()[name]
                raise ValueError(f"custom_logit_processor: {module}.{name} is not available in Tandem")
            if name == "__dict__":
                try:
                    return super().find_class(module, name)
                except ImportError:
                    return self._main.__dict__
            return super().find_class(module, name)

    return _Unpickler


def deserialize(json_str: str) -> Any:
    """A fresh processor (a callable) from its serialized form. Runs the client's code."""
    check_format(json_str)
    raw = bytes.fromhex(json.loads(json_str)["callable"])
    unpickler = _unpickler_class()(io.BytesIO(raw))
    unpickler._main = _namespace()
    obj = unpickler.load()
    if isinstance(obj, type):
        obj = obj()
    if not callable(obj):
        raise ValueError(f"custom_logit_processor: {type(obj).__name__} is not callable")
    return obj


@dataclass
class ProcessorReq:
    """`custom_param_list[i]["__req__"]`: what a processor may read of its request."""

    rid: str
    origin_input_ids: list[int]
    output_ids: list[int]
    sampling_params: Any = None


@dataclass
class RequestProcessor:
    """A request's processor instance and its params dict, kept across steps."""

    processor: Any
    params: dict[str, Any]

    @classmethod
    def build(cls, serialized: str, custom_params: dict[str, Any] | None) -> RequestProcessor:
        return cls(deserialize(serialized), dict(custom_params or {}))


@dataclass
class _Row:
    row: int
    rid: str
    state: RequestProcessor
    req: ProcessorReq


@dataclass
class CustomLogitBatch:
    """The rows of one batch that carry a processor (SamplingBatchInfo.custom). Rows that
    share a processor instance are passed to it in one call. `failed` maps a row to the
    error of its processor (that row's logits are left as they were)."""

    rows: list[_Row]
    failed: dict[int, str] = field(default_factory=dict)

    @classmethod
    def build(cls, entries: list[tuple[int, str, RequestProcessor, ProcessorReq]]) -> CustomLogitBatch | None:
        """`entries`: (row, rid, state, req view) of each row that samples a token."""
        if not entries:
            return None
        return cls([_Row(*e) for e in entries])

    def resolve_output_ids(self, resolve, device: Any = "cpu") -> None:
        """Replace FutureMap placeholders in the rows' output ids (the worker's side)."""
        pending = [r for r in self.rows if r.req.output_ids and r.req.output_ids[-1] < 0]
        if not pending:
            return
        ids = resolve(torch.tensor([r.req.output_ids[-1] for r in pending], dtype=torch.int64, device=device)).tolist()
        for r, token in zip(pending, ids):
            r.req.output_ids = r.req.output_ids[:-1] + [token]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of `logits` with each processor's rows replaced by what it returned."""
        out = logits.clone()
        groups: dict[int, list[_Row]] = {}
        for r in self.rows:
            groups.setdefault(id(r.state.processor), []).append(r)
        for rows in groups.values():
            index = torch.tensor([r.row for r in rows], dtype=torch.int64, device=logits.device)
            params = []
            for r in rows:
                r.state.params[REQ_KEY] = r.req
                params.append(r.state.params)
            try:
                sub = logits.index_select(0, index)
                new = rows[0].state.processor(sub, params)
                new = sub if new is None else new
                if not isinstance(new, torch.Tensor) or tuple(new.shape) != tuple(sub.shape):
                    raise ValueError(
                        f"returned {type(new).__name__} "
                        f"{tuple(new.shape) if isinstance(new, torch.Tensor) else ''}; expected a tensor "
                        f"of shape {tuple(sub.shape)}"
                    )
                new = _force_inf(new)
                if bool(torch.isnan(new).any()) or bool((new == -float("inf")).all(dim=-1).any()):
                    raise ValueError("returned logits with NaN, or a row with every logit -inf")
                out.index_copy_(0, index, new.to(device=out.device, dtype=out.dtype))
            except Exception as e:  # noqa: BLE001 - the client's code: only its requests fail
                message = f"the custom logit processor raised {type(e).__name__}: {e}"
                for r in rows:
                    self.failed[r.row] = message
        return out


def _force_inf(logits: torch.Tensor) -> torch.Tensor:
    """A row with +inf logits means "one of these tokens": they become 0, the rest -inf
    (softmax of +inf is NaN)."""
    pos = logits == float("inf")
    if not bool(pos.any()):
        return logits
    forced = torch.full_like(logits, -float("inf")).masked_fill(pos, 0.0)
    return torch.where(pos.any(dim=-1, keepdim=True), forced, logits)
