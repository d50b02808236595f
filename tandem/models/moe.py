"""What the mixture-of-experts families (`mixtral.py`, `qwen2_moe.py`, `qwen3_moe.py`)
share: the sparse MLP block and the loading of per-expert checkpoint tensors.

`SparseMoeBlock` (a layer's `mlp`): the router (`mlp.gate`, a replicated [E, H] linear),
the experts (`mlp.experts`, `tandem.layers.moe.FusedMoE`) and, for Qwen2-MoE, a shared
expert (`mlp.shared_expert`, a `GatedMLP`) scaled per token by
`sigmoid(mlp.shared_expert_gate(x))`. Under tensor parallelism the experts and the
shared expert return partial sums over their intermediate slices, added before the one
all-reduce of the block.

`MoECausalLM`: a `CausalLM` whose `make_mlp` builds the block on the layers its config
makes sparse, whose `process_weights_after_loading` also prepares the experts' kernels
(and `--quantization`'s blocks), and whose `load_weights` takes the checkpoints' per-expert names
(`mlp.experts.N.{gate,up,down}_proj`, Mixtral's `block_sparse_moe.experts.N.w{1,3,2}`
and `block_sparse_moe.gate`) as well as transformers 5's stacked ones
(`mlp.experts.gate_up_proj` / `down_proj`, the parameters' own names).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import tensor_model_parallel_all_reduce
from tandem.layers.moe import FusedMoE, select_experts
from tandem.layers.weight_shard import CheckpointTensor
from tandem.models.base import DENSE_STACKED_PARAMS, CausalLM, GatedMLP, StackedParam
from tandem.sglang_flags import QUANTIZE_AT_LOAD

logger = logging.getLogger(__name__)

# Qwen2-MoE's shared expert: its gate/up fused like the dense MLP's.
MOE_STACKED_PARAMS: tuple[StackedParam, ...] = DENSE_STACKED_PARAMS + (
    StackedParam("mlp.shared_expert.gate_proj", "mlp.shared_expert.gate_up_proj", 0),
    StackedParam("mlp.shared_expert.up_proj", "mlp.shared_expert.gate_up_proj", 1),
)

# One expert's projection in a checkpoint -> (stacked parameter, the loader's part).
# Without an expert number: one projection of every expert stacked [E, out, in] (GGUF's
# `ffn_{gate,up,down}_exps`, named so by `gguf_loader`).
_EXPERT_NAME = re.compile(
    r"^(?P<prefix>.*)\.(?:mlp|block_sparse_moe)\.experts\.(?:(?P<expert>\d+)\.)?"
    r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$"
)
_EXPERT_PART = {
    "gate_proj": ("gate_up_proj", "gate"),
    "w1": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    "w3": ("gate_up_proj", "up"),
    "down_proj": ("down_proj", "down"),
    "w2": ("down_proj", "down"),
}


def expert_param_target(name: str) -> tuple[str, tuple[int | None, str]] | None:
    """(stacked expert parameter, (expert, part)) for a per-expert checkpoint name; expert
    None for one projection of all experts stacked."""
    m = _EXPERT_NAME.match(name)
    if m is None:
        return None
    param, part = _EXPERT_PART[m["proj"]]
    return f"{m['prefix']}.mlp.experts.{param}", (None if m["expert"] is None else int(m["expert"]), part)


class SparseMoeBlock(nn.Module):
    """Router, experts and the optional gated shared expert of one layer."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_in_model_dtype: bool,
        tp_rank: int,
        tp_size: int,
        shared_intermediate_size: int = 0,
    ):
        super().__init__()
        self.top_k, self.renormalize = top_k, renormalize
        # Mixtral keeps the routing weights in float32; Qwen MoE casts them to the model's dtype.
        self.weights_in_model_dtype = weights_in_model_dtype
        self.tp_size = tp_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate.weight.requires_grad_(False)
        self.experts = FusedMoE(num_experts, hidden_size, intermediate_size, tp_rank, tp_size)
        self.shared_expert = None
        if shared_intermediate_size:
            self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, tp_rank, tp_size)
            self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)
            self.shared_expert_gate.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.gate.weight)
        weights, ids = select_experts(
            router_logits, self.top_k, self.renormalize, x.dtype if self.weights_in_model_dtype else None
        )
        out = self.experts.forward(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert
            # down_proj's matmul without its all-reduce: the block reduces once
            partial = shared.down_proj.matmul(shared.act_fn.forward(shared.gate_up_proj.forward(x)))
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * partial
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


class MoECausalLM(CausalLM):
    """A `CausalLM` with sparse MLP blocks on the layers `is_sparse_layer` names."""

    stacked_params = MOE_STACKED_PARAMS

    @classmethod
    def is_sparse_layer(cls, config, layer_id: int) -> bool:
        """Qwen MoE's rule: not in `mlp_only_layers`, and every `decoder_sparse_step`-th."""
        return (
            layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0
        )

    @classmethod
    def sparse_block(cls, config, tp_rank: int, tp_size: int) -> SparseMoeBlock:
        raise NotImplementedError

    @classmethod
    def make_mlp(cls, config, layer_id: int, tp_rank: int, tp_size: int) -> nn.Module | None:
        return cls.sparse_block(config, tp_rank, tp_size) if cls.is_sparse_layer(config, layer_id) else None

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]], require_all: bool = True) -> None:
        """`CausalLM.load_weights`, the per-expert tensors loaded into the stacked expert
        parameters and Mixtral's `block_sparse_moe` read as `mlp`."""
        params = dict(self.named_parameters())
        experts_loaded: set[str] = set()

        def dense_names(stream):
            for name, tensor in stream:
                target = expert_param_target(name)
                if target is None:
                    yield name.replace(".block_sparse_moe.", ".mlp."), tensor
                    continue
                param_name, shard_id = target
                if param_name not in params:
                    raise ValueError(f"unexpected weight in checkpoint: {name}")
                param = params[param_name]
                param.weight_loader(param, tensor, shard_id)
                experts_loaded.add(param_name)

        loaded = super().load_weights(dense_names(weights), require_all=False)
        missing = set(params) - loaded - experts_loaded
        if missing and require_all:
            raise ValueError(f"weights missing from checkpoint: {sorted(missing)[:5]}")

    def process_weights_after_loading(
        self, linear_backend: str, quantization: str | None = None, int8_x: bool = False
    ) -> None:
        super().process_weights_after_loading(linear_backend, quantization, int8_x)
        at_load = quantization if quantization in QUANTIZE_AT_LOAD else None
        experts = [m for m in self.modules() if isinstance(m, FusedMoE)]
        for module in experts:
            module.process_weights_after_loading(linear_backend, at_load, int8_x)
        if at_load:
            logger.info(
                "--quantization %s: %d of %d expert projections quantized (input width a multiple of 32), "
                "the routers dense",
                at_load,
                sum(m.quantized for m in experts),
                sum(2 * m.num_experts for m in experts),
            )
