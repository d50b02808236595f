"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3's attention (per-head q/k RMSNorm, q/k/v
biases only with `attention_bias`), and on the layers that are not in `mlp_only_layers`
and are every `decoder_sparse_step`-th a sparse MLP of `num_experts` experts (128 in
the released models) of `moe_intermediate_size`, top `num_experts_per_tok`,
renormalized with `norm_topk_prob` (on in the released models), the weights in the
model's dtype; no shared expert. The other layers are dense (`intermediate_size`)."""

from __future__ import annotations

from tandem.models.base import LayerOptions
from tandem.models.moe import MoECausalLM, SparseMoeBlock


class Qwen3MoeForCausalLM(MoECausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", False)), qk_norm=True)

    @classmethod
    def sparse_block(cls, config, tp_rank: int, tp_size: int) -> SparseMoeBlock:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            weights_in_model_dtype=True,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )


EntryClass = [Qwen3MoeForCausalLM]
