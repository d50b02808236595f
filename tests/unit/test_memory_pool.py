"""KV pools: allocation, freeing, writes, and the slot accounting invariant."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from tandem.server_args import PortArgs


def make_kv(size: int = 10) -> TokenToKVPool:
    return TokenToKVPool(size, num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device="cpu")


def test_kv_alloc_and_free_account_for_every_slot():
    pool = make_kv(10)
    assert pool.available_size() == 10
    a = pool.alloc(4)
    b = pool.alloc(6)
    assert pool.alloc(1) is None, "no slot left"
    slots = torch.cat([a, b]).tolist()
    assert sorted(slots) == list(range(1, 11)), "slot 0 is never handed out"
    pool.free(a)
    assert pool.available_size() == 4
    c = pool.alloc(4)
    assert sorted(c.tolist()) == sorted(a.tolist())
    assert pool.alloc(0).numel() == 0


def test_kv_set_and_read_back():
    pool = make_kv(8)
    slots = pool.alloc(3)
    k = torch.randn(3, 2, 4)
    v = torch.randn(3, 2, 4)
    pool.set_kv(1, slots, k, v)
    assert torch.equal(pool.k_buffer[1][slots], k) and torch.equal(pool.v_buffer[1][slots], v)
    assert TokenToKVPool.bytes_per_token(2, 2, 4, torch.float32) == 2 * 2 * 2 * 4 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_set_from_qkv_views_equals_index_copy(dtype):
    """Keys and values as the attention layer passes them (strided views of one QKV output),
    in the C++ kv_write where the kernels are built, land as index_copy_ puts them; other
    slots stay untouched; a slot outside the pool is refused."""
    pool = make_kv(8)
    # The pool's buffers are torch.empty: garbage that may hold NaNs, which torch.equal never
    # matches. Fill them with values so "untouched" can be checked.
    pool.k_buffer = [torch.randn_like(b).to(dtype) for b in pool.k_buffer]
    pool.v_buffer = [torch.randn_like(b).to(dtype) for b in pool.v_buffer]
    pool.dtype = dtype
    before = [b.clone() for b in pool.k_buffer + pool.v_buffer]
    qkv = torch.randn(3, 4 * 4 + 2 * 2 * 4).to(dtype)
    k = qkv[:, 16:24].view(3, 2, 4)
    v = qkv[:, 24:].view(3, 2, 4)
    slots = torch.tensor([5, 2, 7])
    pool.set_kv(1, slots, k, v)
    for buf, new, old in ((pool.k_buffer[1], k, before[1]), (pool.v_buffer[1], v, before[3])):
        expected = old.index_copy(0, slots, new)
        assert torch.equal(buf, expected)
    assert torch.equal(pool.k_buffer[0], before[0]) and torch.equal(pool.v_buffer[0], before[2])
    with pytest.raises((RuntimeError, IndexError)):
        pool.set_kv(1, torch.tensor([0, 1, 100]), k, v)


def test_req_to_token_rows():
    pool = ReqToTokenPool(size=2, max_context_len=16, device="cpu")
    r1, r2 = pool.alloc(), pool.alloc()
    assert {r1, r2} == {0, 1} and pool.alloc() is None
    pool.write(r1, 3, torch.tensor([7, 8, 9]))
    assert pool.req_to_token[r1, 3:6].tolist() == [7, 8, 9]
    pool.free(r1)
    assert pool.available_size() == 1
    with pytest.raises(AssertionError):
        pool.free(r1)


def test_req_to_token_write_one_each():
    """A decode step's write: slot i goes to row rows[i] at positions[i]; nothing else moves."""
    pool = ReqToTokenPool(size=3, max_context_len=8, device="cpu")
    pool.write_one_each([2, 0, 1], [5, 0, 7], torch.tensor([11, 12, 13]))
    expected = torch.zeros(3, 8, dtype=torch.int64)
    expected[2, 5], expected[0, 0], expected[1, 7] = 11, 12, 13
    assert torch.equal(pool.req_to_token, expected)


def test_ipc_directory_is_private():
    args = PortArgs.create()
    try:
        mode = stat.S_IMODE(os.stat(args.ipc_dir).st_mode)
        assert mode == 0o700
        assert args.tokenizer_to_scheduler.startswith(f"ipc://{args.ipc_dir}/")
        assert (
            len(
                {
                    args.tokenizer_to_scheduler,
                    args.scheduler_to_detokenizer,
                    args.detokenizer_to_tokenizer,
                    args.scheduler_to_tokenizer,
                    args.ready,
                }
            )
            == 5
        )
    finally:
        os.rmdir(args.ipc_dir)
