"""The Triton attention kernels against the torch-native backend on the same paged KV
pool: ragged batches, short and long (split-K) contexts, GQA ratios, head sizes that are
not a power of two, extend over a cached prefix, and a prefill run in chunks.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py before Triton is imported); on CUDA they run compiled, and the `cuda` case checks bfloat16 too."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton kernels are untested")

from tandem.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from tandem.layers.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


class Pools:
    """One layer of KV for `seq_lens` requests, at shuffled (non-contiguous) slots."""

    def __init__(self, seq_lens: list[int], kv_heads: int, head_dim: int, dtype=torch.float32, seed: int = 0):
        torch.manual_seed(seed)
        total = sum(seq_lens)
        self.kv = TokenToKVPool(total + 8, 1, kv_heads, head_dim, dtype, DEVICE)
        self.rows = ReqToTokenPool(2 * len(seq_lens), max(seq_lens) + 4, DEVICE)
        slots = (torch.randperm(total + 8)[:total] + 1).to(DEVICE).split(seq_lens)
        self.row_ids = []
        for own in slots:
            self.rows.alloc()  # every other row stays unused
            row = self.rows.alloc()
            self.rows.write(row, 0, own)
            self.row_ids.append(row)
        for buf in self.kv.k_buffer + self.kv.v_buffer:
            buf[1:].copy_(torch.randn(buf[1:].shape, device=DEVICE).to(dtype))

    def batch(self, mode: ForwardMode, seq_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        n = sum(extend_lens)
        zeros = torch.zeros(n, dtype=torch.int64, device=DEVICE)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(seq_lens),
            input_ids=zeros,
            positions=zeros,
            out_cache_loc=zeros,
            req_pool_indices=torch.tensor(self.row_ids, device=DEVICE),
            seq_lens=torch.tensor(seq_lens, device=DEVICE),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=[s - e for s, e in zip(seq_lens, extend_lens)],
            extend_lens_cpu=extend_lens,
        )

    def backends(self, heads: int, head_dim: int):
        return (TritonAttnBackend(self.rows, self.kv, heads, head_dim), TorchNativeAttnBackend(self.rows, self.kv))


def run(backend, q: torch.Tensor, fb: ForwardBatch, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    backend.init_forward_metadata(fb)
    return backend.forward(q.reshape(q.shape[0], -1), 0, fb, head_dim**-0.5, heads, kv_heads, head_dim)


TOL = {"atol": 2e-5, "rtol": 2e-5}


@pytest.mark.parametrize(
    "seq_lens,heads,kv_heads,head_dim",
    [
        ([1, 7, 33, 2], 4, 4, 16),  # MHA, short ragged contexts (one split each)
        ([700, 3, 129], 8, 2, 32),  # GQA 4: a long context runs on all KV splits
        ([65, 300], 8, 1, 48),  # MQA (group 8), head_dim not a power of two
        ([5, 90], 32, 2, 16),  # group 16: one full block of query heads per KV head
        ([40, 2], 32, 1, 16),  # group 32: two blocks of query heads share the KV head
        ([9, 70], 48, 2, 16),  # group 24: a group's heads fill one block and part of the next
        ([33, 4], 40, 2, 16),  # group 20: the second block of a group is mostly padding
        ([12], 36, 3, 16),  # group 12 (below 16, not dividing 16) over three KV heads
    ],
)
def test_decode_matches_torch_native(seq_lens, heads, kv_heads, head_dim):
    pools = Pools(seq_lens, kv_heads, head_dim)
    fb = pools.batch(ForwardMode.DECODE, seq_lens, [1] * len(seq_lens))
    q = torch.randn(len(seq_lens), heads, head_dim, device=DEVICE)
    triton_backend, native = pools.backends(heads, head_dim)
    torch.testing.assert_close(
        run(triton_backend, q, fb, heads, kv_heads, head_dim), run(native, q, fb, heads, kv_heads, head_dim), **TOL
    )


@pytest.mark.parametrize(
    "seq_lens,extend_lens,heads,kv_heads,head_dim",
    [
        ([5, 57, 90], [5, 17, 40], 4, 2, 16),  # no prefix; cached prefixes of 40 and 50 (radix hits)
        ([1, 70], [1, 70], 6, 3, 24),  # a one-token prompt beside a prompt of several query blocks
        ([100], [3], 8, 1, 32),  # short new part on a long prefix, MQA
    ],
)
def test_extend_matches_torch_native(seq_lens, extend_lens, heads, kv_heads, head_dim):
    pools = Pools(seq_lens, kv_heads, head_dim)
    fb = pools.batch(ForwardMode.EXTEND, seq_lens, extend_lens)
    q = torch.randn(sum(extend_lens), heads, head_dim, device=DEVICE)
    triton_backend, native = pools.backends(heads, head_dim)
    torch.testing.assert_close(
        run(triton_backend, q, fb, heads, kv_heads, head_dim), run(native, q, fb, heads, kv_heads, head_dim), **TOL
    )


def test_chunked_prefill_equals_one_shot():
    """A 75-token prompt prefilled as chunks of 32, 32 and 11 (each over the KV of the
    chunks before it) gives the outputs of prefilling it at once."""
    heads, kv_heads, head_dim, n = 4, 2, 16, 75
    pools = Pools([n], kv_heads, head_dim)
    q = torch.randn(n, heads, head_dim, device=DEVICE)
    backend, _ = pools.backends(heads, head_dim)
    whole = run(backend, q, pools.batch(ForwardMode.EXTEND, [n], [n]), heads, kv_heads, head_dim)
    parts, done = [], 0
    for chunk in (32, 32, 11):
        fb = pools.batch(ForwardMode.EXTEND, [done + chunk], [chunk])
        parts.append(run(backend, q[done : done + chunk], fb, heads, kv_heads, head_dim))
        done += chunk
    torch.testing.assert_close(torch.cat(parts), whole, **TOL)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bfloat16_decode_and_extend_on_gpu():
    heads, kv_heads, head_dim = 16, 2, 128
    seq_lens, extend_lens = [1, 513, 4000, 37], [1, 100, 7, 37]
    pools = Pools(seq_lens, kv_heads, head_dim, dtype=torch.bfloat16)
    triton_backend, native = pools.backends(heads, head_dim)
    for mode, ext in ((ForwardMode.DECODE, [1] * 4), (ForwardMode.EXTEND, extend_lens)):
        fb = pools.batch(mode, seq_lens, ext)
        q = torch.randn(sum(ext), heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
        torch.testing.assert_close(
            run(triton_backend, q, fb, heads, kv_heads, head_dim),
            run(native, q, fb, heads, kv_heads, head_dim),
            atol=2e-2,
            rtol=2e-2,
        )
