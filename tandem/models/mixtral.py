"""Mixtral (`MixtralForCausalLM`): Llama's attention, and on every layer a sparse MLP of
`num_local_experts` SiLU experts, `num_experts_per_tok` (2) chosen per token, their
softmax weights renormalized over the chosen and kept in float32 (transformers'
`MixtralTopKRouter`). Checkpoints name the block `block_sparse_moe` (router `gate`,
experts `experts.N.w1` gate, `w3` up, `w2` down); transformers 5 names it `mlp`
(`tandem/models/moe.py` loads both). The config's `sliding_window` is not applied (as
`mistral.py`)."""

from __future__ import annotations

from tandem.models.base import LayerOptions
from tandem.models.moe import MoECausalLM, SparseMoeBlock


class MixtralForCausalLM(MoECausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(qkv_bias=bool(getattr(config, "attention_bias", False)))

    @classmethod
    def is_sparse_layer(cls, config, layer_id: int) -> bool:
        return True

    @classmethod
    def sparse_block(cls, config, tp_rank: int, tp_size: int) -> SparseMoeBlock:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
            weights_in_model_dtype=False,
            tp_rank=tp_rank,
            tp_size=tp_size,
        )


EntryClass = [MixtralForCausalLM]
