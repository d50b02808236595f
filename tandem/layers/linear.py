"""Linear layers that tensor parallelism splits; with tp_size 1 they are plain linears.

Each parameter carries a `weight_loader(param, loaded_weight, shard_id)` that copies the
part of a checkpoint tensor this rank owns into the right place:
  ColumnParallelLinear  splits the output dim; no communication.
  RowParallelLinear     splits the input dim; all-reduces the partial outputs.
  MergedColumnParallelLinear / QKVParallelLinear fuse several column layers (gate+up,
  q+k+v) into one matmul; `shard_id` names which part a checkpoint tensor is.
  ReplicatedLinear      the whole weight on every rank (the LM head).

After loading, `process_weights_after_loading(backend)` picks the matmul kernel
(`tandem.layers.linear_kernel`); a packed kernel holds the only copy of the weight, and
`weight` is then left empty unless the caller keeps it (a head tied to the embedding).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.layers.linear_kernel import LinearKernel, make_linear_kernel


class LinearBase(nn.Module):
    """A linear layer with a per-rank `weight` [out, in] (and `bias`), loaded through
    `weight_loader`, multiplied by the kernel `process_weights_after_loading` chose."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
        self.kernel: LinearKernel | None = None

    # The bias the kernel adds (RowParallelLinear adds its own after the all-reduce).
    def _kernel_bias(self) -> torch.Tensor | None:
        return self.bias

    def process_weights_after_loading(self, backend: str, keep_weight: bool = False) -> None:
        """Choose the matmul kernel for the loaded weight; free `weight` when a packed
        kernel holds it, unless `keep_weight` (it is shared with another module)."""
        self.kernel = make_linear_kernel(self.weight.data, self._kernel_bias(), backend)
        if self.kernel is not None and not keep_weight:
            self.weight.data = torch.empty(0, dtype=self.weight.dtype, device=self.weight.device)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self._kernel_bias())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError


class ColumnParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert out_features % tp_size == 0
        super().__init__(in_features, out_features // tp_size, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        size = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * size, size))


class ReplicatedLinear(LinearBase):
    """The whole weight on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(in_features, out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        param.data.copy_(loaded)


class RowParallelLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        assert in_features % tp_size == 0
        super().__init__(in_features // tp_size, out_features, bias, tp_rank, tp_size)

    def _kernel_bias(self) -> torch.Tensor | None:
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x)
        if self.tp_size > 1:
            torch.distributed.all_reduce(out)
        return out + self.bias if self.bias is not None else out

    def weight_loader(self, param, loaded, shard_id=None):
        if param.dim() == 1:  # bias is not split
            param.data.copy_(loaded)
            return
        size = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * size, size))


class MergedColumnParallelLinear(LinearBase):
    """Several column layers of the same input fused along the output dim."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1):
        assert all(s % tp_size == 0 for s in output_sizes)
        self.shard_sizes = [s // tp_size for s in output_sizes]
        super().__init__(in_features, sum(self.shard_sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        size = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one matmul; shard_id is "q", "k" or "v"."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp_rank: int = 0, tp_size: int = 1):
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, tp_rank, tp_size)

    def weight_loader(self, param, loaded, shard_id=None):
        super().weight_loader(param, loaded, {"q": 0, "k": 1, "v": 2}[shard_id])
