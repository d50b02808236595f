"""CUDA graph buckets (`--cuda-graph-max-bs`, `--cuda-graph-bs`); the graphs themselves
are checked on a GPU (tests/cuda)."""

from __future__ import annotations

from tandem.model_executor.cuda_graph_runner import capture_batch_sizes


def test_default_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_explicit_buckets_are_sorted_and_capped():
    assert capture_batch_sizes(16, [8, 3, 3, 64]) == [3, 8]
