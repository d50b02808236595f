"""A decode step whose layers run as one C++ call (`tandem_cpu.decode_layers`, where every linear
of every layer is quantized), or as one C++ call each (`tandem_cpu.decode_layer`), equals the
same step through the Python layer op by op: the same tokens and bit-identical logits, in
float32 and bfloat16, for a Llama and a Qwen2 (QKV bias) GGUF model, batches of 1 and 3 (and 9
where the rows are int8), on one thread and on two (where the layers run in one OpenMP region,
each kernel's work shared by the threads; weights of 2 MB or more taken in chunks, the threads
taking each other's last ones); batches above QUANT_MAX_ROWS and layers with an
unquantized linear take the Python layer (a model with one such layer runs its other layers one
call each); an error inside the region reaches the caller as an exception."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_gguf
from runner_steps import greedy_steps, make_runner

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear import LinearBase
from tandem.layers.linear_kernel import can_pack
from tandem.layers.quantization.gguf_linear import QUANT_MAX_ROWS
from tandem.tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="Tandem's C++ CPU kernels are not built")

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 70))]
# one request of 2 KV heads on 2 threads, 140 keys: the attention splits each head's keys in parts
LONG = [[1 + (7 * i) % 90 for i in range(140)]]
# nine requests: from 8 rows the AVX-512 VNNI build multiplies by transposed weight tiles
MANY = [[1 + (3 * i + j) % 90 for j in range(5 + i)] for i in range(9)]
STEPS = 6


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    dirs = {arch: make_tiny_model(root / arch, arch=arch, preset="gguf") for arch in ("llama", "qwen2")}
    # llama-iq4: IQ4_XS, the grid layout (4-bit codes into IQ4_NL's values)
    return {
        name: write_gguf(dirs[arch], root / f"{name}.gguf", qtype)
        for name, arch, qtype in (
            ("llama", "llama", "Q4_0"),
            ("qwen2", "qwen2", "Q8_0"),
            ("llama-iq4", "llama", "IQ4_XS"),
        )
    }


def run(runner, prompts, mode: str):
    """Greedy steps with the layers in one call ("stack"), one call each ("layers") or the
    Python layer ("python"); also how many stack calls and fused layer calls ran."""
    model = runner.model.model
    layers = model.layers
    saved = [layer.fused_decode for layer in layers]
    calls = {"stack": 0, "layers": 0}
    for layer in layers:
        if mode == "python":
            layer.fused_decode = None
        original = layer.forward_fused

        def counted(*a, _f=original):
            calls["layers"] += 1
            return _f(*a)

        layer.forward_fused = counted
    stack = model._fused_stack

    def counted_stack():
        found = stack()
        if found is None or mode != "stack":
            return None

        def op(*a):
            calls["stack"] += 1
            return found[0](*a)

        return (op, *found[1:])

    model._fused_stack = counted_stack
    try:
        return greedy_steps(runner, prompts, STEPS), calls
    finally:
        del model._fused_stack
        for layer, value in zip(layers, saved):
            layer.fused_decode = value
            del layer.forward_fused


# 3: shares of unequal size; 8: more threads than a CI machine's cores (threads preempted
# inside the region's phases)
@pytest.fixture(params=[1, 2, 3, 8], ids=["1-thread", "2-threads", "3-threads", "8-threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


# auto: bfloat16 where the CPU has it natively, else float32 rows rounded to int8 (int8_x)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "auto"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama-iq4"])
def test_fused_decode_layers_equal_the_python_layers(gguf_files, arch, dtype, threads):
    runner = make_runner(gguf_files[arch], dtype=dtype)
    layers = runner.model.model.layers
    assert all(layer.fused_decode is not None for layer in layers)
    # only float32 asked for by name keeps the quantized matmuls exact
    assert layers[0].self_attn.qkv_proj.quant_kernel.int8_x == (dtype != "float32")
    assert runner.model.model._fused_stack() is not None
    many = (MANY,) if len(MANY) <= layers[0].fused_decode[3] else ()  # where the kernels take 9 rows
    for prompts in (PROMPTS[:1], PROMPTS, LONG) + many:
        (ids, logits), stack_calls = run(runner, prompts, "stack")
        (layer_ids, layer_logits), layer_calls = run(runner, prompts, "layers")
        (ref_ids, ref_logits), none = run(runner, prompts, "python")
        assert stack_calls == {"stack": STEPS, "layers": 0}
        assert layer_calls == {"stack": 0, "layers": STEPS * len(layers)}
        assert none == {"stack": 0, "layers": 0}
        assert ids == layer_ids == ref_ids
        for got, by_layer, ref in zip(logits, layer_logits, ref_logits):
            assert torch.equal(got, ref) and torch.equal(by_layer, ref)


@pytest.fixture(scope="module")
def wide_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return write_gguf(make_tiny_model(root / "llama", arch="llama", preset="wide"), root / "wide.gguf", "Q8_0")


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_weights_of_2_mb_taken_in_chunks_equal_the_python_layers(wide_file, dtype, threads):
    """Weights of 2 MB or more (the `wide` preset's gate/up, down and q/k/v in Q8_0): the
    region's threads take their tiles in chunks and, their own done, each other's last ones
    (which thread computes an output differs from call to call; the output does not)."""
    runner = make_runner(wide_file, dtype=dtype)
    layers = runner.model.model.layers
    sizes = [m.quant_kernel.q.numel() for m in (layers[0].mlp.gate_up_proj, layers[0].mlp.down_proj)]
    assert min(sizes) >= 2 << 20
    for prompts in (PROMPTS[:1], PROMPTS):
        (ids, logits), stack_calls = run(runner, prompts, "stack")
        (ref_ids, ref_logits), _ = run(runner, prompts, "python")
        assert stack_calls == {"stack": STEPS, "layers": 0}
        assert ids == ref_ids
        for got, ref in zip(logits, ref_logits):
            assert torch.equal(got, ref)


def test_large_batches_and_unquantized_layers_take_the_python_layer(gguf_files):
    runner = make_runner(gguf_files["llama"], dtype="float32")
    layers = runner.model.model.layers
    _, calls = run(runner, [[1, 2, 3]] * (QUANT_MAX_ROWS + 1), "stack")
    assert calls == {"stack": 0, "layers": 0}
    layers[0].mlp.down_proj.quant_kernel = None
    layers[0].prepare_fused_decode()
    assert layers[0].fused_decode is None and layers[1].fused_decode is not None
    assert runner.model.model._fused_stack() is None  # rebuilt: layer 0 runs in Python
    _, calls = run(runner, [[1, 2, 3]], "stack")
    assert calls == {"stack": 0, "layers": STEPS * (len(layers) - 1)}


def test_an_error_inside_the_layers_region_raises_and_the_next_call_runs(gguf_files, threads):
    """A check that fails inside the region (here: a new token's slot out of the pool, met by the
    KV write) is a RuntimeError naming it, on every thread count, as is one met before it (heads
    that do not match the QKV output); the same op then runs again."""
    runner = make_runner(gguf_files["llama"], dtype="float32")
    model = runner.model.model
    stack = model._fused_stack()
    op, weights, layout, eps, scale, heads, kv_heads = stack
    hidden = torch.randn(1, runner.model.config.hidden_size)
    pool = runner.token_to_kv_pool
    n = len(model.layers)
    head_dim = pool.k_buffer[0].shape[-1]
    cos_sin = torch.zeros(1, 2, head_dim // 2)
    tables = (
        torch.zeros(1, dtype=torch.int64),  # the new token's slot
        runner.req_to_token_pool.req_to_token,
        torch.zeros(1, dtype=torch.int64),
        torch.ones(1, dtype=torch.int64),
    )
    args = (eps, cos_sin, pool.k_buffer[:n], pool.v_buffer[:n], *tables, scale)
    with pytest.raises(RuntimeError, match="do not match the heads"):
        op(hidden, weights, layout, *args, heads + 1, kv_heads)
    outside = torch.full((1,), pool.k_buffer[0].shape[0] + 5, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="kv_write: slot .* out of range"):
        op(
            hidden,
            weights,
            layout,
            eps,
            cos_sin,
            pool.k_buffer[:n],
            pool.v_buffer[:n],
            outside,
            *tables[1:],
            scale,
            heads,
            kv_heads,
        )
    out, residual = op(hidden, weights, layout, *args, heads, kv_heads)
    assert out.shape == residual.shape == hidden.shape and torch.isfinite(out).all()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2's head is tied to the embedding
def test_blocks_that_take_every_input_leave_no_dense_copy(gguf_files, arch):
    """bfloat16 on an AVX-512 VNNI build without AMX, or on the AVX2 build where oneDNN packs
    no bfloat16: the quantized kernels take every input (prefill too: `QUANT_MAX_ROWS_ALL`), so
    no layer keeps its dense weight or a oneDNN copy, each keeps its stored tiles, and a tied
    head leaves the table to the embedding's blocks; elsewhere the dense copies stay for
    prefill. Prefill and decode give the tokens of the Python layers either way (the test
    above)."""
    runner = make_runner(gguf_files[arch], dtype="bfloat16")
    model = runner.model
    linears = [m for m in model.modules() if isinstance(m, LinearBase) and m.quant_kernel is not None]
    isa = cpu_kernels.load().quant_linear_isa()
    vnni = isa.startswith("avx512_vnni")
    every = (
        model.model.embed_tokens.weight.dtype == torch.bfloat16
        and not isa.startswith("float,")
        and (not torch.cpu._is_amx_tile_supported() if vnni else not can_pack(torch.empty(2, 2, dtype=torch.bfloat16)))
    )
    assert linears and all(m.serves_every_input() == every for m in linears)
    for m in linears:
        if every:
            assert m.kernel is None and m.weight.numel() == 0 and m.quant_kernel.tiles is not None
        else:
            assert m.weight.numel() > 0 or m.kernel is not None
    assert model.config.tie_word_embeddings == (arch == "qwen2")
    if every and model.config.tie_word_embeddings:
        assert model.model.embed_tokens.packed is not None and model.model.embed_tokens.weight.numel() == 0
    ids, _ = greedy_steps(runner, PROMPTS, 2)
    assert [len(i) for i in ids] == [2] * len(PROMPTS)
