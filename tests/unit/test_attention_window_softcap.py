"""Sliding window and logit soft-capping in every attention backend (#25), against a direct
masked softmax in float64: torch_native's extend (SDPA with the windowed mask, explicit
scores when soft-capped) and its decode through the C++ CPU kernel and through the
PyTorch fallback, and the Triton kernels (under TRITON_INTERPRET=1 on CPU). Prompts longer
than the window, extend over a cached prefix (a chunk, a radix hit), ragged batches, GQA.

The window is transformers': the query at position p sees the keys at (p - window, p]."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tandem.forward_batch import ForwardBatch, ForwardMode
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.attention.torch_native import TorchNativeAttnBackend
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
SCALE = 0.3


class Pools:
    """One layer of KV for `seq_lens` requests at shuffled slots, random keys and values."""

    def __init__(self, seq_lens: list[int], seed: int = 0):
        torch.manual_seed(seed)
        total = sum(seq_lens)
        self.kv = TokenToKVPool(total + 8, 1, KV_HEADS, HEAD_DIM, torch.float32, "cpu")
        self.rows = ReqToTokenPool(len(seq_lens) + 1, max(seq_lens) + 4, "cpu")
        self.slots = list((torch.randperm(total + 8)[:total] + 1).split(seq_lens))
        self.row_ids = []
        for own in self.slots:
            row = self.rows.alloc()
            self.rows.write(row, 0, own)
            self.row_ids.append(row)
        for buf in self.kv.k_buffer + self.kv.v_buffer:
            buf[1:].copy_(torch.randn(buf[1:].shape) * 2)

    def batch(self, mode: ForwardMode, seq_lens: list[int], extend_lens: list[int]) -> ForwardBatch:
        zeros = torch.zeros(sum(extend_lens), dtype=torch.int64)
        return ForwardBatch(
            forward_mode=mode,
            batch_size=len(seq_lens),
            input_ids=zeros,
            positions=zeros,
            out_cache_loc=zeros,
            req_pool_indices=torch.tensor(self.row_ids),
            seq_lens=torch.tensor(seq_lens),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=[s - e for s, e in zip(seq_lens, extend_lens)],
            extend_lens_cpu=extend_lens,
        )

    def reference(self, q, seq_lens, extend_lens, window, cap):
        """Each request's queries (its last extend_len positions) by a float64 masked softmax."""
        outs, start = [], 0
        for slots, seq, n in zip(self.slots, seq_lens, extend_lens):
            k = self.kv.k_buffer[0][slots].double().repeat_interleave(HEADS // KV_HEADS, 1)  # [L, H, D]
            v = self.kv.v_buffer[0][slots].double().repeat_interleave(HEADS // KV_HEADS, 1)
            qr = q[start : start + n].double()  # [n, H, D]
            scores = torch.einsum("nhd,lhd->hnl", qr, k) * SCALE
            if cap > 0:
                scores = cap * torch.tanh(scores / cap)
            qpos = torch.arange(seq - n, seq).view(-1, 1)
            kpos = torch.arange(seq).view(1, -1)
            seen = kpos <= qpos
            if window > 0:
                seen &= kpos > qpos - window
            scores = scores.masked_fill(~seen, float("-inf"))
            outs.append(torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).reshape(n, -1))
            start += n
        return torch.cat(outs).float()


def backends(pools: Pools):
    """(name, backend) of each backend and decode path this machine has."""
    out = []
    native = TorchNativeAttnBackend(pools.rows, pools.kv, num_heads=HEADS)
    if native.decode_kernel is not None:
        out.append(("torch_native+cpp", native))
    fallback = TorchNativeAttnBackend(pools.rows, pools.kv, num_heads=HEADS)
    fallback.decode_kernel = fallback.extend_kernel = None  # the PyTorch decode and extend paths
    out.append(("torch_native", fallback))
    if importlib.util.find_spec("triton") is not None:
        from tandem.layers.attention.triton_backend import TritonAttnBackend

        out.append(("triton", TritonAttnBackend(pools.rows, pools.kv, HEADS, HEAD_DIM)))
    return out


def check(seq_lens, extend_lens, window, cap):
    pools = Pools(seq_lens)
    mode = ForwardMode.DECODE if all(n == 1 for n in extend_lens) else ForwardMode.EXTEND
    q = torch.randn(sum(extend_lens), HEADS, HEAD_DIM) * 2
    want = pools.reference(q, seq_lens, extend_lens, window, cap)
    for name, backend in backends(pools):
        fb = pools.batch(mode, seq_lens, extend_lens)
        backend.init_forward_metadata(fb)
        got = backend.forward(
            q.reshape(q.shape[0], -1).clone(),
            0,
            fb,
            SCALE,
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            sliding_window=window,
            logit_cap=cap,
        )
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5, msg=lambda m, name=name: f"{name}: {m}")


WINDOW_CAP = [(5, 0.0), (0, 2.5), (7, 2.5)]


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_decode_with_window_and_softcap(window, cap):
    # contexts shorter than, equal to and longer than the window; the longest splits (Triton)
    check([3, 7, 40, 150], [1, 1, 1, 1], window, cap)


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_prefill_longer_than_the_window(window, cap):
    check([45, 9, 2], [45, 9, 2], window, cap)


@pytest.mark.parametrize("window,cap", WINDOW_CAP)
def test_extend_over_a_cached_prefix(window, cap):
    # a chunk after a prefix longer than the window, one inside it, one prefix of one token
    check([60, 10, 6], [13, 4, 5], window, cap)


def test_cpu_decode_kernel_window_and_softcap_defaults():
    """The C++ op's `window` and `softcap` default to off (the fused decode layer's call)."""
    ops = cpu_kernels.load()
    if ops is None:
        pytest.skip("no C++ CPU kernels on this machine")
    pools = Pools([20, 3])
    q = torch.randn(2, HEADS, HEAD_DIM)
    args = (pools.kv.k_buffer[0], pools.kv.v_buffer[0], pools.rows.req_to_token, torch.tensor(pools.row_ids))
    lens = torch.tensor([20, 3])
    torch.testing.assert_close(
        ops.decode_attention(q, *args, lens, SCALE), ops.decode_attention(q, *args, lens, SCALE, 0, 0.0)
    )
    torch.testing.assert_close(
        ops.decode_attention(q, *args, lens, SCALE, 4, 0.0), pools.reference(q, [20, 3], [1, 1], 4, 0.0)
    )
