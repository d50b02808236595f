"""Linear layers that tensor parallelism splits; with tp_size 1 they are plain linears.

Each parameter carries a `weight_loader(param, loaded, shard_id)` that copies the part of
a checkpoint tensor this rank owns into the right place (reading only that part from
the file, `tandem.layers.weight_shard`):
  ColumnParallelLinear  splits the output dim; no communication.
  RowParallelLinear     splits the input dim; all-reduces the partial outputs.
  MergedColumnParallelLinear / QKVParallelLinear fuse several column layers (gate+up,
  q+k+v) into one matmul; `shard_id` names which part a checkpoint tensor is.
  QKVParallelLinear splits the attention heads (`HeadSplit`): query heads evenly, KV
  heads evenly too, or, with fewer KV heads than ranks, one KV head per rank,
  replicated on `tp_size / num_kv_heads` ranks.
  The LM head is split along the vocabulary (`layers/vocab_embedding.py`).

After loading, `process_weights_after_loading(backend)` picks the matmul kernel for this
rank's shard (`tandem.layers.linear_kernel`); a packed kernel holds the only copy of the
weight, and `weight` is then left empty unless the caller keeps it (a head tied to the
embedding). A layer loaded from GGUF also keeps its blocks quantized, and inputs of few
rows (decode) multiply those (`tandem.layers.quantization.gguf_linear`, backend `auto`);
`--quantization q8_0|q4_0|q4_1` makes such blocks from a dense checkpoint's weight
(`process_weights_after_loading(backend, quantization=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import tensor_model_parallel_all_reduce
from tandem.layers.linear_kernel import LinearKernel, make_linear_kernel
from tandem.layers.quantization.gguf_linear import (
    QUANT_MAX_ROWS_ALL,
    BlockPart,
    QuantLinearKernel,
    is_gguf_tensor,
    quantize_dense,
)
from tandem.layers.weight_shard import read_shard, read_whole

if TYPE_CHECKING:
    from tandem.lora.batch import LoraBatch


def divide(total: int, tp_size: int, what: str) -> int:
    """`total / tp_size`, or ValueError naming `what` when tp_size does not divide it."""
    if total % tp_size:
        raise ValueError(f"--tp-size {tp_size} does not divide the model's {what} ({total})")
    return total // tp_size


class LinearBase(nn.Module):
    """A linear layer with a per-rank `weight` [out, in] (and `bias`), loaded through
    `weight_loader`, multiplied by the kernel `process_weights_after_loading` chose."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
        self.kernel: LinearKernel | None = None
        self.quant_kernel: QuantLinearKernel | None = None
        self.gguf_parts: list[BlockPart] = []  # where the weight's rows came from, for GGUF
        self.dequantized_types: set[str] = set()
        self.quantized_at_load: str | None = None  # the --quantization method, where it applied
        self.lora_slots = None  # this layer's LoRA weights per slot (`tandem.lora.pool`), when a target

    def keep_blocks(
        self, loaded, dest_row: int, row_start: int, rows: int, col_start: int = 0, cols: int | None = None
    ) -> None:
        """Note that weight rows `[dest_row, +rows)` are `loaded`'s rows `[row_start, ...)`
        (columns `[col_start, +cols)`), when `loaded` is a GGUF tensor."""
        if is_gguf_tensor(loaded):
            cols = self.weight.shape[1] if cols is None else cols
            self.gguf_parts.append(BlockPart(dest_row, loaded, row_start, rows, col_start, cols))

    # The bias the kernel adds (RowParallelLinear adds its own after the all-reduce).
    def _kernel_bias(self) -> torch.Tensor | None:
        return self.bias

    def process_weights_after_loading(
        self, backend: str, keep_weight: bool = False, quantization: str | None = None, int8_x: bool = False
    ) -> None:
        """Choose the matmul kernel for the loaded weight; free `weight` when a packed
        kernel holds it, unless `keep_weight` (it is shared with another module).
        `int8_x`: the quantized kernel rounds float32 rows to int8 too (`QuantLinearKernel`).
        `quantization` (q8_0, q4_0, q4_1) first rounds the weight to that GGUF type where its
        input width allows (`quantize_dense`): the dense kernel then multiplies the
        dequantized values (in the weight's dtype; a shared weight changes for its other
        user too) and, with backend auto, few rows the blocks."""
        parts, self.gguf_parts = self.gguf_parts, []
        self.quant_kernel = None
        packed = quantize_dense(self.weight.data, quantization) if quantization else None
        self.quantized_at_load = quantization if packed is not None else None
        if packed is not None:
            self.weight.data.copy_(torch.from_numpy(packed.dequantize()))
        if backend == "auto":
            self.quant_kernel = (
                QuantLinearKernel.from_packed(packed, self.weight.data, self._kernel_bias(), int8_x)
                if packed is not None
                else QuantLinearKernel.build(parts, self.weight.data, self._kernel_bias(), int8_x)
            )
        # GGUF types this layer serves dequantized only (no quantized kernel for them here)
        self.dequantized_types = {p.loaded.qtype.name for p in parts} if self.quant_kernel is None else set()
        if self.serves_every_input():  # the blocks take prefill too: no dense copy to keep
            self.kernel = None
            if not keep_weight:
                self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)
            return
        self.kernel = make_linear_kernel(self.weight.data, self._kernel_bias(), backend)
        if self.kernel is not None and not keep_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def serves_every_input(self) -> bool:
        """Whether the quantized kernel multiplies inputs of any row count (`quant_max_rows`),
        so that the dense weight is not needed once loaded."""
        return self.quant_kernel is not None and self.quant_kernel.max_rows >= QUANT_MAX_ROWS_ALL

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_kernel is not None and x.numel() <= self.quant_kernel.max_rows * x.shape[-1]:
            return self.quant_kernel(x)
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self._kernel_bias())

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """`lora`: the forward's adapters (`tandem.lora.batch`), whose deltas are added."""
        out = self.matmul(x)
        return out if lora is None else lora.add_delta(self, x, out)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, divide(out_features, tp_size, "output size"), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        param.data.copy_(read_shard(loaded, 0, self.tp_rank * size, size))
        if param.dim() == 2:
            self.keep_blocks(loaded, 0, self.tp_rank * size, size)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(divide(in_features, tp_size, "input size"), out_features, bias, tp_rank, tp_size)

    def _kernel_bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """A LoRA delta is this rank's part too (A split on the input): all-reduced with the output."""
        out = self.matmul(x)
        if lora is not None:
            out = lora.add_delta(self, x, out)
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out + self.bias if self.bias is not None else out

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias is not split
            param.data.copy_(read_whole(loaded))
            return
        size = param.shape[1]
        param.data.copy_(read_shard(loaded, 1, self.tp_rank * size, size))
        self.keep_blocks(loaded, 0, 0, param.shape[0], self.tp_rank * size, size)


class MergedColumnParallelLinear(LinearBase):
    """Several column layers of the same input fused along the output dim. Part i takes
    `shard_sizes[i]` rows of this rank's weight, read from row `shard_starts[i]` of the
    part's checkpoint tensor."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        sizes = [divide(s, tp_size, "fused output sizes") for s in output_sizes]
        self._init_parts(in_features, sizes, [tp_rank * s for s in sizes], bias, tp_rank, tp_size)

    def _init_parts(
        self, in_features: int, sizes: list[int], starts: list[int], bias: bool, tp_rank: int, tp_size: int
    ) -> None:
        self.shard_sizes, self.shard_starts = sizes, starts
        LinearBase.__init__(self, in_features, sum(sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(read_shard(loaded, 0, self.shard_starts[shard_id], size))
        if param.dim() == 2:
            self.keep_blocks(loaded, offset, self.shard_starts[shard_id], size)


@dataclass(frozen=True)
class HeadSplit:
    """The attention heads one rank holds: query heads `[rank * num_heads, ...)`, KV heads
    `[kv_head_start, kv_head_start + num_kv_heads)` of the checkpoint's."""

    num_heads: int
    num_kv_heads: int
    kv_head_start: int

    @classmethod
    def of(cls, total_heads: int, total_kv_heads: int, tp_rank: int, tp_size: int) -> HeadSplit:
        """Query heads split evenly; KV heads too when there are at least as many as
        ranks, else each rank holds the one KV head its query heads attend to (a query
        head h attends to KV head h * total_kv_heads // total_heads)."""
        num_heads = divide(total_heads, tp_size, "attention heads")
        if total_kv_heads >= tp_size:
            per_rank = divide(total_kv_heads, tp_size, "KV heads")
            return cls(num_heads, per_rank, tp_rank * per_rank)
        if tp_size % total_kv_heads:
            raise ValueError(f"--tp-size {tp_size} is not a multiple of the model's KV heads ({total_kv_heads})")
        return cls(num_heads, 1, tp_rank * total_kv_heads // tp_size)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; shard_id is "q", "k" or "v". `heads` says
    which heads this rank holds (KV heads replicated when fewer than the ranks)."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.heads = HeadSplit.of(num_heads, num_kv_heads, tp_rank, tp_size)
        q_size, kv_size = self.heads.num_heads * head_dim, self.heads.num_kv_heads * head_dim
        kv_start = self.heads.kv_head_start * head_dim
        self._init_parts(
            hidden_size, [q_size, kv_size, kv_size], [tp_rank * q_size, kv_start, kv_start], bias, tp_rank, tp_size
        )

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, {"q": 0, "k": 1, "v": 2}[shard_id])
