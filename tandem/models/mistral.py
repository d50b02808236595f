"""Mistral (`MistralForCausalLM`): Llama's layer (no q/k/v bias unless the config says
`attention_bias`). The config's `sliding_window` is not applied: Tandem's attention
backends attend over the whole context (exact for prompts no longer than the window)."""

from __future__ import annotations

from tandem.models.base import CausalLM, LayerOptions


class MistralForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", False)))


EntryClass = [MistralForCausalLM]
