"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): Llama's layer with biases on the q, k and v
projections (always, as transformers' Qwen2Attention; o_proj has none)."""

from __future__ import annotations

from tandem.models.base import CausalLM, LayerOptions


class Qwen2ForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=True)


EntryClass = [Qwen2ForCausalLM]
