"""`--kv-cache-dtype`: a narrower KV pool on CPU, bfloat16 / float16 beside float32 activations
and fp8 (e5m2, e4m3fn) beside float32 or bfloat16 ones (the kernels read it widened, as they
read the widened pool: the checks in tests/decode_attention_checks.py), which dtypes and pairs
start, the default for quantized models (float16, as llama.cpp keeps a GGUF file's cache), and
a float16 / fp8 cache's logits against a float32 one's on the same GGUF file."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from decode_attention_checks import LENGTHS, NARROW_POOLS, SHAPES, check_kv_dtype_pool
from gguf_writer import write_gguf
from runner_steps import greedy_steps, make_runner

from tandem.kernels import cpu as cpu_kernels
from tandem.model_executor.model_loader import check_model
from tandem.model_executor.model_runner import resolve_kv_cache_dtype
from tandem.server_args import ServerArgs
from tandem.tools.make_tiny_model import make_tiny_model

ops = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(ops is None, reason="Tandem's C++ CPU kernels could not be built here")


@needs_kernel
@pytest.mark.parametrize("q_dtype,kv_dtype", NARROW_POOLS)
@pytest.mark.parametrize("num_heads,kv_heads,head_dim", SHAPES)
def test_a_narrower_pool_reads_as_the_kernels_read_it_widened(q_dtype, kv_dtype, num_heads, kv_heads, head_dim):
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        check_kv_dtype_pool(ops, kv_dtype, num_heads, kv_heads, head_dim, LENGTHS["7-requests"][0], q_dtype)
    finally:
        torch.set_num_threads(saved)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [16, 64])  # the generic loops, and (64) the AVX2 ones
def test_the_fp8_widening_is_exact_for_every_byte(dtype, head_dim):
    """Each of the 256 bytes of an fp8 dtype, widened by the kernels, equals PyTorch's widening,
    NaNs included: decode attention over one key is that key's value row."""
    values = torch.arange(256, dtype=torch.uint8).view(dtype)
    want = values.float()
    k, v = torch.zeros(2, 1, head_dim, dtype=dtype), torch.zeros(2, 1, head_dim, dtype=dtype)
    got = []
    for b in range(0, 256, head_dim):
        v[1, 0] = values[b : b + head_dim]
        out = ops.decode_attention(
            torch.zeros(1, 1, head_dim), k, v, torch.tensor([[1]]), torch.tensor([0]), torch.tensor([1]), 1.0
        )
        got.append(out.view(head_dim))
    got = torch.cat(got)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])


def test_auto_is_the_activations_dtype_but_float16_for_quantized_weights_on_cpu():
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    assert resolve_kv_cache_dtype("auto", f32, "cpu") == f32
    assert resolve_kv_cache_dtype("auto", f32, "cpu", quantized=True) == f16
    assert resolve_kv_cache_dtype("auto", bf16, "cpu", quantized=True) == bf16
    assert resolve_kv_cache_dtype("auto", f32, "cuda", quantized=True) == f32
    assert resolve_kv_cache_dtype("fp16", f32, "cpu") == f16
    assert resolve_kv_cache_dtype("bf16", f32, "cpu", quantized=True) == bf16
    assert resolve_kv_cache_dtype("float32", f32, "cpu", quantized=True) == f32
    assert resolve_kv_cache_dtype("bfloat16", bf16, "cuda") == bf16
    assert resolve_kv_cache_dtype("fp8_e5m2", f32, "cpu") == torch.float8_e5m2
    assert resolve_kv_cache_dtype("fp8_e4m3", bf16, "cpu") == torch.float8_e4m3fn


@pytest.mark.parametrize(
    "kv,dtype,device",
    [
        ("float16", torch.bfloat16, "cpu"),
        ("float32", torch.bfloat16, "cpu"),
        ("float16", torch.float32, "cuda"),
        ("fp8_e5m2", torch.float16, "cpu"),
        ("fp8_e4m3", torch.bfloat16, "cuda"),
    ],
)
def test_other_pairs_stop_with_a_message_naming_the_flag(kv, dtype, device):
    with pytest.raises(ValueError, match=f"--kv-cache-dtype {kv} with"):
        resolve_kv_cache_dtype(kv, dtype, device)


def test_a_pair_that_cannot_run_stops_the_start_before_any_subprocess(tmp_path):
    """check_model (run by launch_server and the Engine before they start anything) refuses a
    float16 cache beside bfloat16 activations with the flag's one line."""
    args = ServerArgs(
        model_path=str(make_tiny_model(tmp_path / "m", arch="llama", preset="gguf")),
        device="cpu",
        dtype="bfloat16",
        kv_cache_dtype="fp16",
    )
    args.validate()
    with pytest.raises(ValueError, match="^--kv-cache-dtype fp16 with bfloat16 activations on CPU"):
        check_model(args)
    check_model(dataclasses.replace(args, dtype="float32"))


def _args(value: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/m", "--kv-cache-dtype", value]))


@pytest.mark.parametrize(
    "value", ["fp16", "float16", "bf16", "bfloat16", "fp32", "float32", "auto", "fp8_e5m2", "fp8_e4m3"]
)
def test_kv_dtypes_built_start(value):
    _args(value).validate()


@pytest.mark.parametrize("value", ["fp4_e2m1", "int8"])
def test_kv_dtypes_not_built_stop_the_start(value):
    with pytest.raises(ValueError, match="^--kv-cache-dtype .*fp8_e4m3"):
        _args(value).validate()


@pytest.fixture(scope="module")
def q8_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("kvdtype")
    return write_gguf(make_tiny_model(root / "llama", arch="llama", preset="gguf"), root / "llama-Q8_0.gguf", "Q8_0")


PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 70))]
STEPS = 8


@needs_kernel
def test_a_quantized_gguf_gets_a_float16_cache_by_default(q8_gguf):
    """Under --dtype auto a Q8_0 file's linears round float32 activations to int8; its cache is
    then float16, and the decode steps still run every layer in one C++ call (decode_layers).
    (A CPU with native bfloat16 serves the file in bfloat16: the cache takes that dtype.) The
    default model's perplexity under this default: tests/server/test_quantized_accuracy.py."""
    runner = make_runner(q8_gguf, kv_cache_dtype="auto")
    if runner.dtype == torch.bfloat16:
        assert runner.token_to_kv_pool.k_buffer[0].dtype == torch.bfloat16
        return
    assert runner.kv_cache_dtype == torch.float16 and runner.token_to_kv_pool.k_buffer[0].dtype == torch.float16
    fused = []
    stack = runner.model.model._fused_stack
    runner.model.model._fused_stack = lambda: fused.append(stack()) or fused[-1]
    greedy_steps(runner, PROMPTS, STEPS)
    assert len(fused) == STEPS and all(s is not None for s in fused)


@needs_kernel
def test_a_float16_cache_against_a_float32_one(q8_gguf):
    """The cache's rounding alone (the exact float32 weights path, no int8 activations), prefill
    and decode: logits within 2e-3 of their largest while the greedy tokens agree (measured on
    this random model: 7.5e-4; its near-flat logits let a prompt's tokens part after 4-5 steps)."""
    got = greedy_steps(make_runner(q8_gguf, dtype="float32", kv_cache_dtype="float16"), PROMPTS, STEPS)
    want = greedy_steps(make_runner(q8_gguf, dtype="float32", kv_cache_dtype="float32"), PROMPTS, STEPS)
    agree = next((s for s in range(STEPS) if [ids[s] for ids in got[0]] != [ids[s] for ids in want[0]]), STEPS)
    assert agree >= 3, (got[0], want[0])
    for a, b in list(zip(got[1], want[1]))[: agree + 1]:  # step s's logits chose token s
        assert (a - b).abs().max() <= 2e-3 * b.abs().max(), ((a - b).abs().max(), b.abs().max())


@needs_kernel
def test_the_exact_float32_reference_keeps_a_float32_cache(q8_gguf):
    """--dtype float32 by name multiplies the exact weight values (no int8 rounding): its cache
    stays float32 under auto."""
    runner = make_runner(q8_gguf, dtype="float32", kv_cache_dtype="auto")
    assert runner.token_to_kv_pool.k_buffer[0].dtype == torch.float32


@needs_kernel
def test_a_dense_model_keeps_its_activations_dtype(tmp_path):
    runner = make_runner(
        make_tiny_model(tmp_path / "m", arch="llama", preset="gguf"), dtype="float32", kv_cache_dtype="auto"
    )
    assert runner.token_to_kv_pool.k_buffer[0].dtype == torch.float32


# (activations, fp8 pool): the most the first steps' logits may differ from the same
# activations' full-width cache, relative to their largest (measured on this random model,
# whose near-flat logits part the tokens early: 7.6e-2, 2.2e-1).
FP8_LOGIT_BOUNDS = [("float32", "fp8_e4m3", 0.15), ("bfloat16", "fp8_e5m2", 0.4)]


@needs_kernel
@pytest.mark.parametrize("dtype,kv,bound", FP8_LOGIT_BOUNDS)
def test_an_fp8_cache_runs_the_fused_decode_steps(q8_gguf, dtype, kv, bound):
    """An fp8 pool beside float32 or bfloat16 activations: every decode step runs the layers in
    one C++ call (decode_layers reads and writes the fp8 pool), and the logits stay near a
    full-width cache's while the greedy tokens agree. (The default model's perplexity with
    an fp8 cache: tests/server/test_quantized_accuracy.py.)"""
    runner = make_runner(q8_gguf, dtype=dtype, kv_cache_dtype=kv)
    assert runner.token_to_kv_pool.k_buffer[0].dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    fused = []
    stack = runner.model.model._fused_stack
    runner.model.model._fused_stack = lambda: fused.append(stack()) or fused[-1]
    got = greedy_steps(runner, PROMPTS, STEPS)
    assert len(fused) == STEPS and all(s is not None for s in fused)
    want = greedy_steps(make_runner(q8_gguf, dtype=dtype, kv_cache_dtype=dtype), PROMPTS, STEPS)
    agree = next((s for s in range(STEPS) if [ids[s] for ids in got[0]] != [ids[s] for ids in want[0]]), STEPS)
    for a, b in list(zip(got[1], want[1]))[: agree + 1]:
        a, b = a.float(), b.float()
        assert (a - b).abs().max() <= bound * b.abs().max(), ((a - b).abs().max(), b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float8_e5m2, torch.float8_e4m3fn])
def test_set_kv_writes_an_fp8_pool_without_the_kernel(dtype):
    """PyTorch's path of `set_kv` (no C++ kernel: here rows whose head dim is strided, which
    kv_write does not take) rounds the rows as the cast does, though PyTorch's index_copy_ has no
    fp8 kernel."""
    from tandem.mem_cache.memory_pool import TokenToKVPool

    pool = TokenToKVPool(8, 1, 2, 16, dtype, "cpu")
    k, v = torch.randn(3, 2, 32)[..., ::2] * 10, torch.randn(3, 2, 32)[..., ::2]
    slots = torch.tensor([5, 2, 7])
    pool.set_kv(0, slots, k, v)
    assert torch.equal(pool.k_buffer[0][slots].view(torch.uint8), k.to(dtype).view(torch.uint8))
    assert torch.equal(pool.v_buffer[0][slots].view(torch.uint8), v.to(dtype).view(torch.uint8))
