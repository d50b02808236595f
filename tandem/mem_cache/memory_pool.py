"""KV memory: `ReqToTokenPool` (request rows -> KV slots) and `TokenToKVPool` (slots -> K, V).

Page size is 1: every token owns one slot. Slot 0 of the KV pool is never handed out; it
is the padding slot that dummy or masked positions may write to harmlessly.
"""

from __future__ import annotations

import functools

import torch

from tandem.kernels import cpu as cpu_kernels
from tandem.utils.huge_pages import HugePageArena


class ReqToTokenPool:
    """One row per running request; `req_to_token[row, pos]` is the KV slot of token `pos`."""

    def __init__(self, size: int, max_context_len: int, device: str):
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._flat = self.req_to_token.view(-1)
        self._free_rows: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row, or None when every row is taken."""
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.size and row not in self._free_rows, f"double free of row {row}"
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots

    def write_one_each(self, rows: list[int], positions: list[int], slots: torch.Tensor) -> None:
        """`req_to_token[rows[i], positions[i]] = slots[i]` for every i (a decode step's
        new slots, one per request) in one indexed copy, not one write per request."""
        width = self.max_context_len
        flat = torch.tensor([row * width + pos for row, pos in zip(rows, positions)], device=self.req_to_token.device)
        self._flat.index_copy_(0, flat, slots)


FP8_POOLS = (torch.float8_e5m2, torch.float8_e4m3fn)


def widened_pool(activations: torch.dtype, pool: torch.dtype) -> bool:
    """Whether a pool of dtype `pool` is a narrower one beside the activations (--kv-cache-dtype,
    on CPU): 16-bit beside float32 activations, fp8 beside float32 or bfloat16 ones. Keys and
    values are rounded as they are written and widened as attention reads them."""
    if pool in FP8_POOLS:
        return activations in (torch.float32, torch.bfloat16)
    return activations == torch.float32 and pool in (torch.bfloat16, torch.float16)


class TokenToKVPool:
    """Per-layer K and V buffers of shape [size + 1, num_kv_heads, head_dim], indexed by slot.

    Free slots are kept in a tensor; `alloc(n)` hands out n of them, `free` takes them back.
    Invariant: every slot in 1..size is either free or held by exactly one owner.
    """

    def __init__(self, size: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
        self.size = size
        self.num_layers = num_layers
        self.dtype = dtype
        self.device = device
        shape = (size + 1, num_kv_heads, head_dim)
        # NOTE: empty, not zeros: pages of a large CPU pool are only touched when used.
        # Attention reads only slots a request owns, plus slot 0 as masked padding, so
        # slot 0 is zeroed: masked garbage (NaN * 0 weight) would poison the output.
        # On CPU the buffers lie in huge pages (tandem/utils/huge_pages.py): decode
        # attention reads a request's keys and values from all over a layer's buffer, and
        # in 4 KB pages a TLB miss came every few keys (the C++ decode kernel, 16 requests
        # of 350 keys, 30 layers, 2 Zen 4 threads: 0.94 of its time in huge pages).
        if torch.device(device).type == "cpu":
            meta = torch.empty(shape, dtype=dtype, device="meta")
            arena = HugePageArena(HugePageArena.size_of([meta] * 2 * num_layers))
            make = arena.empty
        else:
            make = functools.partial(torch.empty, device=device)
        self.k_buffer = [make(shape, dtype=dtype) for _ in range(num_layers)]
        self.v_buffer = [make(shape, dtype=dtype) for _ in range(num_layers)]
        for buf in self.k_buffer + self.v_buffer:
            buf[0].zero_()
        self.clear()

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()

    def clear(self) -> None:
        self._free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return int(self._free_slots.numel())

    def alloc(self, n: int) -> torch.Tensor | None:
        """n free slots, or None when fewer than n are free."""
        if n > self._free_slots.numel():
            return None
        out, self._free_slots = self._free_slots[:n], self._free_slots[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if slots.numel():
            self._free_slots = torch.cat([self._free_slots, slots.to(self._free_slots.device)])

    def set_kv(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The tokens' keys and values [n, kv_heads, head_dim] into `slots` of the layer (on CPU
        in one call of Tandem's C++ `kv_write` where the dtypes match, or the rows are rounded
        into a narrower pool: `widened_pool`)."""
        k_buffer, v_buffer = self.k_buffer[layer_id], self.v_buffer[layer_id]
        widened = widened_pool(k.dtype, self.dtype) and k_buffer.is_cpu
        ops = cpu_kernels.ops_for(k, v) if widened else cpu_kernels.ops_for(k, v, k_buffer)
        if ops is not None and slots.dtype == torch.int64 and k.stride(-1) == v.stride(-1) == 1:
            ops.kv_write(k_buffer, v_buffer, slots, k, v)
            return
        if self.dtype in FP8_POOLS:  # PyTorch's index_copy_ has no fp8 kernel: copied as bytes
            k_buffer, v_buffer = k_buffer.view(torch.uint8), v_buffer.view(torch.uint8)
            k, v = k.to(self.dtype).view(torch.uint8), v.to(self.dtype).view(torch.uint8)
        k_buffer.index_copy_(0, slots, k.to(k_buffer.dtype))
        v_buffer.index_copy_(0, slots, v.to(v_buffer.dtype))
