"""Maps a config's `architectures` entry to the model class that implements it.

Lazy: `ARCHITECTURES` names each architecture's family module, and only the module of the
architecture asked for is imported. Each family module lists its classes in `EntryClass`
(SGLang's convention); `resolve_model_class` takes the one of the architecture's name, and
tests/unit/test_model_registry.py checks the two agree."""

from __future__ import annotations

import importlib

from torch import nn

# architecture name (config.json's `architectures`) -> module under tandem.models
ARCHITECTURES: dict[str, str] = {
    "Gemma2ForCausalLM": "gemma",
    "Gemma3ForCausalLM": "gemma",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}


def model_class(arch: str) -> type[nn.Module]:
    """The class serving architecture `arch` (KeyError if it is not in ARCHITECTURES),
    importing its family's module."""
    module = importlib.import_module(f"tandem.models.{ARCHITECTURES[arch]}")
    for cls in module.EntryClass:
        if cls.__name__ == arch:
            return cls
    raise ImportError(f"tandem.models.{ARCHITECTURES[arch]} has no EntryClass named {arch}")


def resolve_model_class(config) -> type[nn.Module]:
    for arch in getattr(config, "architectures", None) or []:
        if arch in ARCHITECTURES:
            return model_class(arch)
    raise ValueError(
        f"model architectures {getattr(config, 'architectures', None)} are not supported; "
        f"supported: {sorted(ARCHITECTURES)}"
    )
