"""Mistral (`MistralForCausalLM`): Llama's layer (no q/k/v bias unless the config says
`attention_bias`), every layer with the config's `sliding_window` when it has one (the
query at p sees the keys at (p - window, p], as transformers)."""

from __future__ import annotations

from tandem.models.base import CausalLM, LayerOptions


class MistralForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            sliding_window=int(getattr(config, "sliding_window", None) or 0),
        )


EntryClass = [MistralForCausalLM]
