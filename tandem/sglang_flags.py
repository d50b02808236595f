"""SGLang's everyday server flags that Tandem accepts so that SGLang command lines run.

Each flag is a `ServerArgs` field (its default lives there). Three kinds:
- the flags whose feature exists work (`--tp-size 2`, `--load-format dummy`, ...): they
  are listed here with the values Tandem can honour;
- NO_EFFECT flags tune something this build does not have (CUDA graphs, torch.compile,
  ...): a value other than the default is accepted and logged once;
- NOT_BUILT flags ask for a feature Tandem lacks (DP attention, embedding models,
  parallelism > 1, ...): a value other than the neutral one stops the start with one
  line naming the flag.
docs/api.md lists them all.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.function_call.function_call_parser import ToolCallParserEnum
from tandem.reasoning_parser import REASONING_PARSERS

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompatFlag:
    """One SGLang flag: its names, how argparse reads it, and what Tandem does with it."""

    dest: str
    names: tuple[str, ...]
    reason: str
    # Values Tandem honours; anything else is logged (no_effect) or refused (not built).
    ok: Callable[[Any], bool]
    no_effect: bool = False
    parse: dict[str, Any] = field(default_factory=dict)


def _is(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


def _at_least(low: int) -> Callable[[Any], bool]:
    return lambda v: v >= low


# `--quantization` methods that quantize a Hugging Face checkpoint's linear weights at load
# to the GGUF type of that name (tandem.layers.quantization.gguf_linear.quantize_dense).
QUANTIZE_AT_LOAD = ("q8_0", "q4_0", "q4_1")

# `--kv-cache-dtype` values built: auto (the activations' dtype) and the dtypes by name
# (tandem.model_executor.model_runner.resolve_kv_cache_dtype says which pairs run).
KV_CACHE_DTYPES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16", "fp8_e5m2", "fp8_e4m3")

_OFF = _is(None, False)
_INT = {"type": int}
_FLAG = {"action": "store_true"}

COMPAT_FLAGS: tuple[CompatFlag, ...] = (
    # Features that exist, in the form that exists.
    CompatFlag(
        "tp_size",
        ("--tp-size", "--tp", "--tensor-parallel-size"),
        "the tensor-parallel size must be at least 1",
        _at_least(1),
        parse=_INT,
    ),
    CompatFlag(
        "dp_size",
        ("--dp-size", "--dp", "--data-parallel-size"),
        "the data-parallel size must be at least 1",
        _at_least(1),
        parse=_INT,
    ),
    CompatFlag(
        "pp_size",
        ("--pp-size", "--pipeline-parallel-size"),
        "pipeline parallelism is not built yet (only 1)",
        _is(1),
        parse=_INT,
    ),
    CompatFlag(
        "ep_size",
        ("--ep-size", "--expert-parallel-size"),
        "expert parallelism is not built yet (only 1; --tp-size splits every expert's intermediate size instead)",
        _is(1),
        parse=_INT,
    ),
    CompatFlag("nnodes", ("--nnodes",), "the number of nodes must be at least 1", _at_least(1), parse=_INT),
    CompatFlag(
        "tokenizer_worker_num",
        ("--tokenizer-worker-num",),
        "the number of tokenizer workers must be at least 1",
        _at_least(1),
        parse=_INT,
    ),
    CompatFlag(
        "load_format",
        ("--load-format",),
        "only auto, safetensors, gguf and dummy are built",
        _is("auto", "safetensors", "gguf", "dummy"),
    ),
    CompatFlag(
        "page_size", ("--page-size",), "paged KV memory is not built yet (only page size 1)", _is(None, 1), parse=_INT
    ),
    CompatFlag(
        "kv_cache_dtype",
        ("--kv-cache-dtype",),
        "fp4 KV caches are not built; the dtypes built are " + ", ".join(KV_CACHE_DTYPES),
        _is(*KV_CACHE_DTYPES),
    ),
    CompatFlag(
        "quantization",
        ("--quantization",),
        "not supported; the methods built are gguf (a GGUF model's own blocks; implied by a GGUF "
        f"path) and {', '.join(QUANTIZE_AT_LOAD)} (a Hugging Face checkpoint quantized at load)",
        _is(None, "gguf", *QUANTIZE_AT_LOAD),
    ),
    # Features Tandem does not have.
    CompatFlag("enable_dp_attention", ("--enable-dp-attention",), "DP attention is not built yet", _OFF, parse=_FLAG),
    CompatFlag("is_embedding", ("--is-embedding",), "embedding models are not built yet", _OFF, parse=_FLAG),
    CompatFlag(
        "reasoning_parser",
        ("--reasoning-parser",),
        f"the reasoning parsers are {', '.join(REASONING_PARSERS)}",
        _is(None, *REASONING_PARSERS),
    ),
    CompatFlag(
        "tool_call_parser",
        ("--tool-call-parser",),
        f"the tool-call parsers built are {', '.join(ToolCallParserEnum)}",
        _is(None, *ToolCallParserEnum),
    ),
    # Accepted, with no effect in this build.
    CompatFlag(
        "trust_remote_code",
        ("--trust-remote-code",),
        "Tandem runs no code from the model directory",
        _OFF,
        no_effect=True,
        parse=_FLAG,
    ),
    CompatFlag("revision", ("--revision",), "models load from a local directory (no model hub)", _OFF, no_effect=True),
    CompatFlag(
        "tokenizer_mode", ("--tokenizer-mode",), "the fast tokenizer is always used", _is("auto"), no_effect=True
    ),
    CompatFlag(
        "torch_compile_max_bs",
        ("--torch-compile-max-bs",),
        "--enable-torch-compile compiles for every batch size (dynamic shapes, no buckets)",
        _OFF,
        no_effect=True,
        parse=_INT,
    ),
    CompatFlag(
        "disable_custom_all_reduce",
        ("--disable-custom-all-reduce",),
        "the all-reduce is always torch.distributed's (no custom all-reduce)",
        _OFF,
        no_effect=True,
        parse=_FLAG,
    ),
    CompatFlag(
        "enable_p2p_check",
        ("--enable-p2p-check",),
        "GPU peer access is left to NCCL",
        _OFF,
        no_effect=True,
        parse=_FLAG,
    ),
    CompatFlag(
        "grammar_backend",
        ("--grammar-backend",),
        "the grammar backends are xgrammar, llguidance, outlines (or none: structured output refused)",
        _is("xgrammar", "llguidance", "outlines", "none"),
    ),
    CompatFlag("base_gpu_id", ("--base-gpu-id",), "the first GPU id must be at least 0", _at_least(0), parse=_INT),
    CompatFlag(
        "sampling_backend",
        ("--sampling-backend",),
        "the sampler is plain PyTorch",
        _is(None, "pytorch"),
        no_effect=True,
    ),
    CompatFlag(
        "show_time_cost", ("--show-time-cost",), "time-cost marks are not built", _OFF, no_effect=True, parse=_FLAG
    ),
    CompatFlag(
        "decode_log_interval",
        ("--decode-log-interval",),
        "decode statistics are not logged",
        _is(40),
        no_effect=True,
        parse=_INT,
    ),
    CompatFlag(
        "enable_cache_report",
        ("--enable-cache-report",),
        "cached tokens are always in meta_info.cached_tokens; OpenAI usage does not report them yet",
        _OFF,
        no_effect=True,
        parse=_FLAG,
    ),
    CompatFlag(
        "allow_auto_truncate",
        ("--allow-auto-truncate",),
        "prompts longer than the context are refused with 400, not truncated",
        _OFF,
        no_effect=True,
        parse=_FLAG,
    ),
)


def add_compat_args(parser: argparse.ArgumentParser, defaults: dict[str, Any]) -> None:
    """Register every flag of COMPAT_FLAGS; `defaults` are ServerArgs' field defaults."""
    group = parser.add_argument_group("SGLang compatibility", "SGLang's flags; see docs/api.md")
    for flag in COMPAT_FLAGS:
        kind = "no effect here" if flag.no_effect else "other values stop the start"
        group.add_argument(
            *flag.names,
            dest=flag.dest,
            default=defaults[flag.dest],
            help=f"SGLang's flag ({kind}: {flag.reason}).",
            **flag.parse,
        )


def check_compat_flags(args: Any) -> list[str]:
    """Raise ValueError naming the first flag that asks for a feature Tandem lacks; return
    one line per accepted flag that has no effect here (for the log)."""
    notes = []
    for flag in COMPAT_FLAGS:
        value = getattr(args, flag.dest)
        if flag.ok(value):
            continue
        if not flag.no_effect:
            raise ValueError(f"{flag.names[0]} {_show(value)}: {flag.reason}")
        notes.append(f"{flag.names[0]} {_show(value)} has no effect here: {flag.reason}")
    return notes


def _show(value: Any) -> str:
    if value is True:
        return "(set)"
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)
