"""An arena of transparent huge pages, for the weights every decode step streams and the
KV cache every decode step's attention reads.

A decode step at batch 1 reads each quantized weight once, one stream per linear layer.
In 4 KB pages such a stream crosses a page every 4 KB: a TLB miss each time (a small
model's weights are tens of MB, far past what the TLB covers) and a restart of the
hardware prefetchers, which stop at page boundaries. In 2 MB pages the same stream ran
10-25% faster on a 2-core Zen 4 (docs/perf-log/one-stream-engine.md, "Huge pages").
PyTorch's allocator asks for huge pages only under THP_MEM_ALLOC_ENABLE and only for
tensors of 2 MB and more, which a small model's per-layer weights are not; so the
weights are copied one after another into one mapping that asks for them itself.

Linux grants them to anonymous memory advised with MADV_HUGEPAGE when
/sys/kernel/mm/transparent_hugepage/enabled is "always" or "madvise" (the usual default).
Elsewhere, or when the advice is refused, the arena is ordinary memory: the copies are
the same values and nothing else changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h
ALIGN = 64  # each tensor starts on a cache line


def _advise_huge_pages(address: int, length: int) -> bool:
    """madvise(MADV_HUGEPAGE) on [address, address + length); False where refused."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


class HugePageArena:
    """`nbytes` of anonymous memory, advised for huge pages before its first touch;
    `take(t)` copies a CPU tensor into the next free, 64-byte aligned part of it."""

    def __init__(self, nbytes: int):
        # One huge page more, to start on a huge-page boundary.
        length = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE
        if sys.platform == "linux":
            # NOTE: MAP_PRIVATE: mmap's default for anonymous memory is MAP_SHARED (shmem,
            # which follows shmem_enabled instead). The tensor keeps the mapping alive.
            mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self._buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        else:
            self._buffer = torch.empty(length, dtype=torch.uint8)
        start = -self._buffer.data_ptr() % HUGE_PAGE
        self.huge = sys.platform == "linux" and _advise_huge_pages(self._buffer.data_ptr() + start, length - start)
        self._next, self._end = start, start + nbytes

    @staticmethod
    def size_of(tensors: list[torch.Tensor]) -> int:
        """Bytes an arena needs to `take` each of `tensors`."""
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of `t` in the arena (same dtype, shape and values)."""
        out = self.empty(t.shape, t.dtype)
        out.copy_(t)
        return out

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor in the next free, 64-byte aligned part of the arena, its
        values whatever is there (zeros where no page was touched yet: the kernel maps a
        page when it is first written or read)."""
        nbytes = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        if self._next + nbytes > self._end:
            raise ValueError(f"the arena has {self._end - self._next} bytes left, not {nbytes}")
        out = self._buffer[self._next : self._next + nbytes].view(dtype).view(shape)
        self._next += -(-nbytes // ALIGN) * ALIGN
        return out
