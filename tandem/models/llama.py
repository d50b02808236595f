"""Llama (`LlamaForCausalLM`): the plain decoder of `tandem/models/base.py`, with q/k/v
biases when the config says `attention_bias` (o_proj has none here). Tied embeddings,
GQA, head_dim and RoPE scaling come from the config in the shared blocks."""

from __future__ import annotations

from tandem.models.base import CausalLM, LayerOptions


class LlamaForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", False)))


# The classes this file serves, under their `architectures` names (tandem/models/registry.py).
EntryClass = [LlamaForCausalLM]
