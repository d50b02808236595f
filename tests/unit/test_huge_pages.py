"""The huge-page arena (tandem/utils/huge_pages.py) that the quantized weights are moved
into: exact copies, aligned, alive after the arena object is gone, and on Linux with
transparent huge pages available, backed by huge pages."""

from __future__ import annotations

import gc
import re
import sys
from pathlib import Path

import pytest
import torch

from tandem.utils.huge_pages import ALIGN, HugePageArena

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def anon_huge_kb(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_are_exact_aligned_and_outlive_the_arena():
    tensors = [
        torch.randn(100, 30),
        torch.randint(0, 256, (500, 17), dtype=torch.uint8),  # rows of an odd width
        torch.randn(7).half(),
        torch.empty(0, 4),
    ]
    arena = HugePageArena(HugePageArena.size_of(tensors))
    copies = [arena.take(t) for t in tensors]
    del arena
    gc.collect()
    for t, c in zip(tensors, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert torch.equal(c, t)
        assert c.data_ptr() % ALIGN == 0 or c.numel() == 0
    copies[1][0, 0] = 255 - tensors[1][0, 0]  # a copy, not a view of the original
    assert not torch.equal(copies[1], tensors[1])


def test_taking_more_than_its_size_is_refused():
    arena = HugePageArena(100)
    arena.take(torch.zeros(16))  # 64 bytes
    with pytest.raises(ValueError, match="bytes left"):
        arena.take(torch.zeros(16))


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available here",
)
def test_the_arena_is_backed_by_huge_pages():
    big = torch.randint(0, 256, (6 << 20,), dtype=torch.uint8)
    arena = HugePageArena(big.numel())
    copy = arena.take(big)
    assert arena.huge
    assert anon_huge_kb(copy.data_ptr()) >= 2048


def test_empty_gives_aligned_tensors_and_refuses_past_the_end():
    arena = HugePageArena(HugePageArena.size_of([torch.empty(3, 5), torch.empty(10, dtype=torch.uint8)]))
    a = arena.empty((3, 5), torch.float32)
    b = arena.empty((10,), torch.uint8)
    assert a.shape == (3, 5) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() % ALIGN == 0 and b.data_ptr() % ALIGN == 0 and b.data_ptr() >= a.data_ptr() + 60
    a.fill_(1.0)
    b.fill_(7)
    assert a.eq(1.0).all() and b.eq(7).all()  # the two do not overlap
    with pytest.raises(ValueError, match="bytes left"):
        arena.empty((1,), torch.uint8)


@pytest.mark.skipif(
    sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text(),
    reason="transparent huge pages are not available here",
)
def test_the_cpu_kv_pool_lies_in_huge_pages():
    """The KV pool's buffers on CPU (decode attention reads them all over): in huge pages
    once touched, and usable as before."""
    from tandem.mem_cache.memory_pool import TokenToKVPool

    pool = TokenToKVPool(20000, 2, 3, 64, torch.bfloat16, "cpu")
    k = pool.k_buffer[1]
    assert k.shape == (20001, 3, 64) and k[0].eq(0).all()
    k.fill_(1.0)  # touch every page
    assert anon_huge_kb(k.data_ptr()) >= 2048
    slots = pool.alloc(3)
    pool.set_kv(1, slots, torch.full((3, 3, 64), 2.0).bfloat16(), torch.full((3, 3, 64), 3.0).bfloat16())
    assert pool.k_buffer[1][slots].eq(2.0).all() and pool.v_buffer[1][slots].eq(3.0).all()
