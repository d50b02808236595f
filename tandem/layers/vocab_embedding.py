"""The embedding and the LM head, split along the vocabulary across tensor-parallel ranks.

The vocabulary is padded to a multiple of tp_size (no padding with one rank) and rank r
holds rows `[r * shard, (r + 1) * shard)`; rows past the real vocabulary are zeros.
- `VocabParallelEmbedding`: each rank looks up the ids in its rows (zeros for the
  others) and the ranks' vectors are summed (all-reduce): the same bytes as a lookup in
  the whole table.
- `ParallelLMHead`: each rank multiplies by its rows; the logits are all-gathered and the
  padding cut, so every rank holds the same full logits (and samples the same token).
A head tied to the embedding shares its parameter: both are split the same way.

An embedding loaded from GGUF blocks that has a packed layout (`gguf_repack`) and is not
shared with the head (or whose tied head multiplies its own copy of the blocks for every
input: `LinearBase.serves_every_input`) keeps only those blocks (`finish_loading`)
and dequantizes the rows a forward looks up: the same values as the dense table (both are
`Packed.dequantize` rounded to the dtype), a quarter to a half of its memory (a Llama 3
vocabulary of 128,256 x 4,096 in Q4_K: 0.4 GB of blocks instead of 1 GB of bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tandem.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear import LinearBase
from tandem.layers.quantization.gguf_linear import is_gguf_tensor
from tandem.layers.quantization.gguf_repack import Packed, repack
from tandem.layers.weight_shard import CheckpointTensor, read_shard


@dataclass(frozen=True)
class VocabShard:
    """Rows `[start, start + size)` of the padded vocabulary; `[start, end)` are real tokens."""

    vocab_size: int
    start: int
    end: int
    size: int

    @classmethod
    def of(cls, vocab_size: int, tp_rank: int, tp_size: int) -> VocabShard:
        size = -(-vocab_size // tp_size)
        start = tp_rank * size
        return cls(vocab_size, start, max(start, min(start + size, vocab_size)), size)

    def load(self, param: nn.Parameter, loaded: CheckpointTensor) -> None:
        """Copy this shard's rows of a [vocab, hidden] checkpoint tensor; zero the padding."""
        real = self.end - self.start
        if real:
            param.data[:real].copy_(read_shard(loaded, 0, self.start, real))
        param.data[real:].zero_()


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_size = tp_size
        self.shard = VocabShard.of(num_embeddings, tp_rank, tp_size)
        self.weight = nn.Parameter(torch.empty(self.shard.size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self._loaded: CheckpointTensor | None = None  # the checkpoint tensor, until finish_loading
        self.packed: Packed | None = None  # the shard's GGUF blocks, when they replace the table
        self._packed_tensors: tuple[torch.Tensor, ...] = ()  # its q, scale and mn as tensors (shared)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        self.shard.load(param, loaded)
        self._loaded = loaded

    def finish_loading(self, shared_with_head: bool) -> None:
        """Unless the table is also the head's weight, serve lookups from this shard's GGUF
        blocks and free the dense table, where the loaded tensor has a packed layout covering
        the shard's real rows (module docstring)."""
        loaded, self._loaded = self._loaded, None
        real = self.shard.end - self.shard.start
        if (
            shared_with_head
            or not is_gguf_tensor(loaded)
            or real != self.shard.size
            or self.weight.device.type != "cpu"
        ):
            return
        blocks = np.ascontiguousarray(loaded.blocks[self.shard.start : self.shard.end])
        packed = repack(blocks, loaded.qtype, (real, loaded.shape[1]))
        if packed is not None:
            self.packed = packed
            self._packed_tensors = tuple(torch.from_numpy(a) for a in (packed.q, packed.scale, packed.mn))
            self.weight.data = torch.empty(0, self.weight.shape[1], dtype=self.weight.dtype)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return F.embedding(ids, self.weight)
        p, flat = self.packed, ids.reshape(-1)
        ops = cpu_kernels.load()
        if ops is not None:  # the same values, one C++ call (numpy's ~10 calls: ~0.1 ms a decode step)
            q, scale, mn = self._packed_tensors
            values = ops.quant_rows(q, scale, mn, p.code, p.group, flat.long(), self.weight.dtype)
            return values.view(*ids.shape, -1)
        values = p.take_rows(flat.numpy()).dequantize()
        return torch.from_numpy(values).view(*ids.shape, -1).to(self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(ids)
        outside = (ids < self.shard.start) | (ids >= self.shard.start + self.shard.size)
        local = (ids - self.shard.start).masked_fill(outside, 0)
        out = self._lookup(local).masked_fill(outside.unsqueeze(-1), 0.0)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(LinearBase):
    """hidden [n, hidden] -> logits [n, vocab] on every rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int = 0, tp_size: int = 1):
        self.shard = VocabShard.of(vocab_size, tp_rank, tp_size)
        super().__init__(hidden_size, self.shard.size, False, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
        self.shard.load(param, loaded)
        self.keep_shard_blocks(loaded)

    def keep_shard_blocks(self, loaded: CheckpointTensor) -> None:
        """Note this rank's rows of a [vocab, hidden] GGUF tensor (also for a head tied to the
        embedding, whose weight the embedding loads)."""
        self.keep_blocks(loaded, 0, self.shard.start, self.shard.end - self.shard.start)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.matmul(x)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[..., : self.shard.vocab_size]
