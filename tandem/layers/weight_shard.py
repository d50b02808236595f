"""Reading the part of a checkpoint tensor that this rank owns.

Weight loaders get either a `torch.Tensor` or a safetensors slice
(`safe_open(...).get_slice(name)`, what `model_loader.iterate_weights` yields), which
reads from the file only the rows it is indexed with: each tensor-parallel rank reads
its own shard, never the whole tensor. Both are indexed the same way, so loaders use
these two functions and need not know which they have.
"""

from __future__ import annotations

from typing import Any

import torch

# A torch.Tensor or a safetensors PySafeSlice.
CheckpointTensor = Any


def read_shard(loaded: CheckpointTensor, dim: int, start: int, length: int) -> torch.Tensor:
    """`loaded.narrow(dim, start, length)`, reading only those rows from the file."""
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def read_whole(loaded: CheckpointTensor) -> torch.Tensor:
    return loaded[...]
