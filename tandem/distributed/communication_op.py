"""The collectives of the tensor-parallel layers, over the default process group (the
TP group's world: NCCL on CUDA, gloo on CPU). Callers skip them when tp_size is 1."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the ranks, in place; every rank gets the same bytes."""
    dist.all_reduce(x)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x` concatenated along `dim`, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def tensor_model_parallel_min(value: int, device: str) -> int:
    """The smallest of every rank's `value`."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def tensor_model_parallel_all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable `obj`, in rank order."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
