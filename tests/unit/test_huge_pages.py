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
