"""A decode step whose layers run as one C++ call each (`tandem_cpu.decode_layer`, where every
linear of a layer is quantized) equals the same step through the Python layer op by op: the
same tokens and bit-identical logits, in float32 and bfloat16, for a Llama and a Qwen2 (QKV
bias) GGUF model, batches of 1 and 3; batches above QUANT_MAX_ROWS and layers with an
unquantized linear take the Python layer."""

from __future__ import annotations

import pytest
import torch
from gguf_writer import write_gguf
from runner_steps import greedy_steps, make_runner

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.quantization.gguf_linear import QUANT_MAX_ROWS
from tandem.tools.make_tiny_model import make_tiny_model

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="Tandem's C++ CPU kernels are not built")

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 70))]
STEPS = 6


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fused")
    return {
        arch: write_gguf(make_tiny_model(root / arch, arch=arch, preset="gguf"), root / f"{arch}.gguf", qtype)
        for arch, qtype in (("llama", "Q4_0"), ("qwen2", "Q8_0"))
    }


def run(runner, prompts, fused: bool):
    """Greedy steps with the fused layers on or off; also how many layer calls were fused."""
    layers = runner.model.model.layers
    saved = [layer.fused_decode for layer in layers]
    calls = []
    for layer in layers:
        if not fused:
            layer.fused_decode = None
        original = layer.forward_fused
        layer.forward_fused = lambda *a, _f=original: calls.append(1) or _f(*a)
    try:
        return greedy_steps(runner, prompts, STEPS), len(calls)
    finally:
        for layer, value in zip(layers, saved):
            layer.fused_decode = value
            del layer.forward_fused


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_layers_equal_the_python_layers(gguf_files, arch, dtype):
    runner = make_runner(gguf_files[arch], dtype=dtype)
    layers = runner.model.model.layers
    assert all(layer.fused_decode is not None for layer in layers)
    for prompts in (PROMPTS[:1], PROMPTS):
        (ids, logits), fused_calls = run(runner, prompts, fused=True)
        (ref_ids, ref_logits), none = run(runner, prompts, fused=False)
        assert fused_calls == STEPS * len(layers) and none == 0
        assert ids == ref_ids
        for got, ref in zip(logits, ref_logits):
            assert torch.equal(got, ref)


def test_large_batches_and_unquantized_layers_take_the_python_layer(gguf_files):
    runner = make_runner(gguf_files["llama"], dtype="float32")
    layers = runner.model.model.layers
    _, fused_calls = run(runner, [[1, 2, 3]] * (QUANT_MAX_ROWS + 1), fused=True)
    assert fused_calls == 0
    layers[0].mlp.down_proj.quant_kernel = None
    layers[0].prepare_fused_decode()
    assert layers[0].fused_decode is None and layers[1].fused_decode is not None
