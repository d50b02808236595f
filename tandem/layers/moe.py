"""The fused expert layer of mixture-of-experts models (SGLang's `FusedMoE`).

`select_experts`: router logits -> softmax (float32) -> top-k, optionally renormalized
over the k chosen (Mixtral; Qwen MoE's `norm_topk_prob`), the weights kept in float32
(Mixtral) or cast to the model's dtype (Qwen2-MoE, Qwen3-MoE), as transformers does.

`fused_experts`: the (token, expert) assignments flattened and sorted by expert once
(one argsort, no Python loop over tokens), each active expert's tokens then a contiguous
slice multiplied by that expert's gate/up and down weights (two matmuls per active
expert), the outputs weighted and scatter-added back to their tokens (`index_add_`).

`FusedMoE` holds every expert's weights stacked, in transformers 5's layout and names:
`gate_up_proj` [E, 2 * I, H] (gate rows first) and `down_proj` [E, H, I]. Checkpoints
store one tensor per expert and projection (`experts.N.gate_proj` / `w1`, ...); the
weight loader takes those (shard id `(N, "gate"|"up"|"down")`), the stacked 3-D tensor
(shard id None), or one projection of every expert stacked [E, out, in] as GGUF files
hold them (`(None, "gate"|"up"|"down")`; a quantized file's blocks are kept per expert).
Under tensor parallelism each rank holds a slice of every expert's intermediate dimension
(gate/up rows, down columns): the layer returns partial sums and its caller all-reduces once
(`reduce=True` does it here).

After loading, `process_weights_after_loading(backend, quantization)` gives each expert's two
matmuls the dense linears' kernel (`make_linear_kernel`: oneDNN's packed layout on CPU with
`auto`, 1.1-2.5x faster than `torch.mm` on the stacked slices, docs/perf-log/moe.md) and,
under `--quantization q8_0|q4_0|q4_1`, each projection's GGUF blocks with Tandem's C++
quantized kernel for an expert's slices of few tokens (decode), as the dense linears.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.distributed import tensor_model_parallel_all_reduce
from tandem.layers.activation import SiluAndMul
from tandem.layers.linear import divide
from tandem.layers.linear_kernel import LinearKernel, make_linear_kernel
from tandem.layers.quantization.gguf_linear import (
    QUANT_MAX_ROWS_ALL,
    BlockPart,
    QuantLinearKernel,
    is_gguf_tensor,
    quantize_dense,
)
from tandem.layers.weight_shard import read_shard


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]): softmax in float32 over the experts, top-k,
    divided by their sum when `renormalize`, cast to `weights_dtype` when given."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if weights_dtype is not None:
        weights = weights.to(weights_dtype)
    return weights, ids


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    act: nn.Module | None = None,
    kernels: tuple[list[LinearKernel], list[LinearKernel]] | None = None,
) -> torch.Tensor:
    """sum_j topk_weights[t, j] * down_e(act(gate_up_e(x[t]))), e = topk_ids[t, j], for
    every token t of `x` [T, H]; `w13` [E, 2I, H], `w2` [E, H, I]. The result is in x's
    dtype (each weighted expert output rounded to it before the sum, as transformers).
    `kernels`: each expert's gate/up and down matmul (`FusedMoE.process_weights_after_loading`),
    used instead of `torch.mm` on the slices of `w13` / `w2`."""
    act = act or SiluAndMul()
    tokens, k = topk_ids.shape
    num_experts = w13.shape[0]
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _experts_without_host_sync(x, w13, w2, topk_weights, topk_ids, act, out)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // k  # the token of each assignment, in expert order
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # one host sync
    rows = x.index_select(0, token_of)
    expert_out = torch.empty(tokens * k, x.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        end = start + n
        if kernels is not None:
            hidden = act.forward(kernels[0][expert](rows[start:end]))
            expert_out[start:end] = kernels[1][expert](hidden)
        else:
            hidden = act.forward(torch.mm(rows[start:end], w13[expert].t()))
            torch.mm(hidden, w2[expert].t(), out=expert_out[start:end])
        start = end
    weighted = (expert_out * topk_weights.reshape(-1)[order].unsqueeze(1)).to(x.dtype)
    return out.index_add_(0, token_of, weighted)


def _experts_without_host_sync(x, w13, w2, topk_weights, topk_ids, act, out):
    """`fused_experts` while a CUDA graph is captured (no host sync allowed): every
    expert over every token, weighted by its (mostly zero) routing weight."""
    dense = torch.zeros(x.shape[0], w13.shape[0], dtype=topk_weights.dtype, device=x.device)
    dense.scatter_(1, topk_ids, topk_weights)
    for expert in range(w13.shape[0]):
        y = torch.mm(act.forward(torch.mm(x, w13[expert].t())), w2[expert].t())
        out.add_((y * dense[:, expert : expert + 1]).to(x.dtype))
    return out


def _rows_dispatch(quant: QuantLinearKernel, dense: LinearKernel | None, weight: torch.Tensor) -> LinearKernel:
    """A few rows on the quantized blocks, more on the dense kernel (`LinearBase.matmul`'s rule)."""
    if dense is None:
        weight = weight.clone()  # the stacked tensor stays, but its slice must not change under us

        def dense(x):
            return torch.mm(x, weight.t())

    def matmul(x: torch.Tensor) -> torch.Tensor:
        return quant(x) if x.shape[0] <= quant.max_rows else dense(x)

    return matmul


class FusedMoE(nn.Module):
    """Every expert's SiLU-gated MLP, stacked; `forward(x, topk_weights, topk_ids)`."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        reduce: bool = False,
    ):
        super().__init__()
        self.num_experts = num_experts
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.intermediate = divide(intermediate_size, tp_size, "expert intermediate size")
        self.reduce = reduce
        i = self.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        for p in (self.gate_up_proj, self.down_proj):
            p.weight_loader = self.weight_loader
        self.act_fn = SiluAndMul()
        self.kernels: tuple[list[LinearKernel], list[LinearKernel]] | None = None
        # where each expert's gate/up and down weights came from in a GGUF file (`BlockPart`s)
        self.gguf_parts: tuple[list[list[BlockPart]], ...] = tuple([[] for _ in range(num_experts)] for _ in "gd")

    def process_weights_after_loading(
        self, backend: str, quantization: str | None = None, int8_x: bool = False
    ) -> None:
        """Each expert's two matmuls on `backend`'s kernel (`make_linear_kernel`: oneDNN's
        packed layout on CPU with `auto`), which then holds the only copy of the weights;
        left on `torch.mm` over the stacked tensors where the backend packs none.
        `quantization` (q8_0, q4_0, q4_1) first rounds each expert's projection to that GGUF
        type where its input width is a whole number of blocks (as `LinearBase` does): the
        dense kernel multiplies the dequantized values, and with `auto` an expert's slice of
        few tokens the blocks (Tandem's C++ kernel, `QuantLinearKernel.max_rows`). `quantized`: how
        many of the 2 * E projections were. Experts loaded from a GGUF file's quantized
        stacks keep that file's blocks so, with `auto`, where the type has a layout
        (`QuantLinearKernel.build`, as a dense linear's); `on_file_blocks`: how many.
        `int8_x`: as `LinearBase.process_weights_after_loading`'s."""
        self.kernels, self.quantized, self.on_file_blocks = None, 0, 0
        per_proj = []
        gguf_parts, self.gguf_parts = self.gguf_parts, tuple([[] for _ in range(self.num_experts)] for _ in "gd")
        for param, parts in zip((self.gate_up_proj, self.down_proj), gguf_parts):
            kernels = []
            for e in range(self.num_experts):
                weight = param.data[e]
                quant = None
                packed = quantize_dense(weight, quantization) if quantization else None
                if packed is not None:
                    weight.copy_(torch.from_numpy(packed.dequantize()))
                    self.quantized += 1
                    if backend == "auto":
                        quant = QuantLinearKernel.from_packed(packed, weight, None, int8_x)
                elif backend == "auto":  # a GGUF file's blocks, where they have a layout
                    quant = QuantLinearKernel.build(parts[e], weight, None, int8_x)
                    self.on_file_blocks += quant is not None
                if quant is not None and quant.max_rows >= QUANT_MAX_ROWS_ALL:
                    kernels.append(quant)  # every input takes the blocks: no dense copy
                    continue
                dense = make_linear_kernel(weight, None, backend)
                kernels.append(_rows_dispatch(quant, dense, weight) if quant is not None else dense)
            per_proj.append(kernels)
        if all(k is not None for k in per_proj[0] + per_proj[1]):
            self.kernels = (per_proj[0], per_proj[1])
            for p in (self.gate_up_proj, self.down_proj):
                p.data = torch.empty(p.shape[0], 0, 0, dtype=p.dtype, device=p.device)

    def weight_loader(self, param: nn.Parameter, loaded, shard_id: tuple[int, str] | None = None) -> None:
        """Copy this rank's slice of `loaded`: one expert's projection for shard id
        `(expert, "gate"|"up"|"down")` ([I, H] or [H, I] as checkpoints store them), or the
        stacked [E, 2I, H] / [E, H, I] tensor for None."""
        i, start = self.intermediate, self.tp_rank * self.intermediate
        if shard_id is None:
            if param is self.down_proj:
                param.data.copy_(read_shard(loaded, 2, start, i))
            else:  # gate rows [0, I) then up rows [I, 2I) of the checkpoint's stack
                full = i * self.tp_size
                param.data[:, :i].copy_(read_shard(loaded, 1, start, i))
                param.data[:, i:].copy_(read_shard(loaded, 1, full + start, i))
            return
        expert, kind = shard_id
        if expert is None:  # this projection of every expert, stacked [E, out, in]
            offset = 0 if kind != "up" else i
            dest = param.data if kind == "down" else param.data[:, offset : offset + i]
            dest.copy_(read_shard(loaded, 2 if kind == "down" else 1, start, i))
            if is_gguf_tensor(loaded):
                for e in range(self.num_experts):
                    self._keep_blocks(e, kind, loaded.part(e))
            return
        if kind == "down":
            param.data[expert].copy_(read_shard(loaded, 1, start, i))
        else:
            offset = 0 if kind == "gate" else i
            param.data[expert, offset : offset + i].copy_(read_shard(loaded, 0, start, i))
        if is_gguf_tensor(loaded):
            self._keep_blocks(expert, kind, loaded)

    def _keep_blocks(self, expert: int, kind: str, loaded) -> None:
        """Note where expert `expert`'s `kind` rows (or, for down, columns) came from in a
        GGUF file (`loaded`: that expert's 2-D tensor), for its quantized kernel."""
        i, start = self.intermediate, self.tp_rank * self.intermediate
        if kind == "down":
            part = BlockPart(0, loaded, 0, loaded.shape[0], start, i)
        else:
            part = BlockPart(0 if kind == "gate" else i, loaded, start, i, 0, loaded.shape[1])
        self.gguf_parts[0 if kind != "down" else 1][expert].append(part)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        out = fused_experts(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, self.act_fn, self.kernels)
        if self.reduce and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out
