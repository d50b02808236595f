"""CUDA graph buckets (`--cuda-graph-max-bs`, `--cuda-graph-bs`); the graphs themselves
are checked on a GPU (tests/cuda)."""

from __future__ import annotations

import pytest

from tandem.model_executor.cuda_graph_runner import CudaGraphRunner, capture_batch_sizes


def test_default_buckets():
    assert capture_batch_sizes(1) == [1]
    assert capture_batch_sizes(6) == [1, 2, 4, 6]
    assert capture_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_batch_sizes(30) == [1, 2, 4, 8, 16, 24, 30]
    sizes = capture_batch_sizes(256)
    assert sizes[:5] == [1, 2, 4, 8, 16] and sizes[-1] == 256 and len(sizes) == 35
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_explicit_buckets_are_sorted_and_capped():
    """Sizes above the cap (--cuda-graph-max-bs, at most --max-running-requests) give way
    to the cap itself, as in SGLang: the largest batch that can run still has a graph."""
    assert capture_batch_sizes(16, [8, 3, 3, 64]) == [3, 8, 16]
    assert capture_batch_sizes(16, [8, 3, 16]) == [3, 8, 16]
    assert capture_batch_sizes(16, [2, 8]) == [2, 8]


def test_explicit_buckets_all_above_the_cap():
    """--cuda-graph-bs 32 64 with --max-running-requests 4: one bucket of 4 (the list was
    empty and the start died with an IndexError in CudaGraphRunner)."""
    assert capture_batch_sizes(4, [32, 64]) == [4]
    assert capture_batch_sizes(1, [2]) == [1]


def test_runner_refuses_an_empty_bucket_list_by_name():
    with pytest.raises(ValueError, match="--cuda-graph-bs"):
        CudaGraphRunner(lambda fb: None, object(), [], 10, "cpu")
