"""Qwen3 (`Qwen3ForCausalLM`): Llama's layer with a per-head RMSNorm of q and k before
RoPE (`self_attn.q_norm` / `k_norm`), q/k/v biases only when the config says
`attention_bias`. The q/k norms keep its layers off the C++ fused decode path."""

from __future__ import annotations

from tandem.models.base import CausalLM, LayerOptions


class Qwen3ForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)


EntryClass = [Qwen3ForCausalLM]
