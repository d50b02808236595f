"""A LoRA adapter in PEFT's format, read into host memory: `adapter_config.json` and
`adapter_model.safetensors` (or `adapter_model.bin`).

PEFT names a weight `base_model.model.<module>.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]); the delta of module `m` is `x @ A.T @ B.T * scaling` with
`scaling = lora_alpha / r` (rsLoRA, `use_rslora`: `lora_alpha / sqrt(r)`). Here B is
kept pre-scaled. Modules are the checkpoint's own (`q_proj`, ..., `down_proj`); the model's
fused layers (`qkv_proj`, `gate_up_proj`) take them as parts through the family's
`stacked_params`, as the base weights do (`tandem.models.base.stacked_param_target`).

Errors (`ValueError`) name the adapter and the module: a rank above `--max-lora-rank`, a
module the model does not have or does not target (`--lora-target-modules`), a shape that
does not match the base layer, a PEFT feature not applied here (DoRA, bias, embedding
LoRA, `modules_to_save`, per-module rank or alpha patterns).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

# PEFT's names for the projections a decoder layer has (SGLang's set).
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTarget:
    """Where a checkpoint module's delta goes: the model's linear layer `layer` (dotted
    name), part `part` of its fused output (0 for an unfused layer)."""

    layer: str
    part: int


@dataclass
class LoraAdapter:
    """One adapter's weights, whole (not split for tensor parallelism): per target,
    A [r, in] and the scaled B [out, r]."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: frozenset[str]  # PEFT module names (q_proj, ...)
    weights: dict[LoraTarget, tuple[torch.Tensor, torch.Tensor]]


def read_config(path: str, name: str) -> dict:
    config_file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(config_file):
        raise ValueError(f"LoRA adapter {name!r}: no adapter_config.json in {path!r}")
    with open(config_file) as f:
        config = json.load(f)
    for key, why in (
        ("use_dora", "DoRA"),
        ("rank_pattern", "per-module ranks (rank_pattern)"),
        ("alpha_pattern", "per-module alphas (alpha_pattern)"),
        ("modules_to_save", "modules_to_save"),
    ):
        if config.get(key):
            raise ValueError(f"LoRA adapter {name!r}: {why} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {name!r}: bias={config['bias']!r} is not supported (only 'none')")
    return config


def config_target_modules(config: dict) -> set[str]:
    """The PEFT module names an adapter config targets (a regex string targets those of
    SUPPORTED_MODULES it names; 'all-linear' all of them)."""
    targets = config.get("target_modules") or []
    if isinstance(targets, str):
        if targets == "all-linear":
            return set(SUPPORTED_MODULES)
        return {m for m in SUPPORTED_MODULES if m in targets}
    return set(targets)


def _read_tensors(path: str, name: str) -> dict[str, torch.Tensor]:
    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(st):
        return load_file(st)
    binary = os.path.join(path, "adapter_model.bin")
    if os.path.isfile(binary):
        return torch.load(binary, map_location="cpu", weights_only=True)
    raise ValueError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path!r}")


def load_adapter(
    name: str,
    path: str,
    max_rank: int,
    resolve: Callable[[str], LoraTarget | None],
    base_shapes: dict[LoraTarget, tuple[int, int]],
) -> LoraAdapter:
    """Read adapter `name` from directory `path`. `resolve(module_path)` maps a checkpoint
    module (`model.layers.0.self_attn.q_proj`) to its `LoraTarget`, or None when the
    model has no LoRA buffer for it; `base_shapes[target]` is the (out, in) of the base
    part, whole."""
    config = read_config(path, name)
    tensors = _read_tensors(path, name)
    rank = int(config.get("r", 0))
    if rank > max_rank:
        raise ValueError(f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}")
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        module, sep, kind = key.removeprefix(_PREFIX).rpartition(".lora_")
        if not sep or kind not in ("A.weight", "B.weight"):
            raise ValueError(f"LoRA adapter {name!r}: weight {key!r} is not a LoRA A/B matrix Tandem applies")
        pairs.setdefault(module, {})[kind[0]] = tensor
    weights: dict[LoraTarget, tuple[torch.Tensor, torch.Tensor]] = {}
    modules: set[str] = set()
    for module, ab in pairs.items():
        short = module.rsplit(".", 1)[-1]
        if short not in SUPPORTED_MODULES:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} is not supported ({', '.join(SUPPORTED_MODULES)})"
            )
        target = resolve(module)
        if target is None:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} is not a LoRA target of this server "
                "(--lora-target-modules, or the model has no such layer)"
            )
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: module {module!r} lacks its lora_{'AB'[('A' in ab)]} weight")
        a, b = ab["A"], ab["B"]
        out_features, in_features = base_shapes[target]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] > max_rank:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} has A {list(a.shape)} and B {list(b.shape)} "
                f"(rank at most --max-lora-rank {max_rank})"
            )
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise ValueError(
                f"LoRA adapter {name!r}: module {module!r} shapes A {list(a.shape)}, B {list(b.shape)} do not "
                f"match the base layer ([r, {in_features}], [{out_features}, r])"
            )
        weights[target] = (a.float(), b.float() * scaling)
        modules.add(short)
    return LoraAdapter(name, path, rank, scaling, frozenset(modules), weights)
