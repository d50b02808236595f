"""Qwen2-MoE / Qwen1.5-MoE (`Qwen2MoeForCausalLM`): Qwen2's attention (q/k/v biases as
the config's `qkv_bias`, on by default), and on the layers that are not in
`mlp_only_layers` and are every `decoder_sparse_step`-th a sparse MLP: `num_experts`
experts of `moe_intermediate_size`, top `num_experts_per_tok`, renormalized only with
`norm_topk_prob` (off by default), the weights in the model's dtype; plus a shared
expert (`mlp.shared_expert`, `shared_expert_intermediate_size`) scaled per token by
`sigmoid(mlp.shared_expert_gate(x))`. The other layers are dense (`intermediate_size`)."""

from __future__ import annotations

from tandem.models.base import LayerOptions
from tandem.models.moe import MoECausalLM, SparseMoeBlock


class Qwen2MoeForCausalLM(MoECausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)))

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
            shared_intermediate_size=config.shared_expert_intermediate_size,
        )


EntryClass = [Qwen2MoeForCausalLM]
