"""`--quantization q8_0|q4_0|q4_1`: a Hugging Face checkpoint's linear weights rounded at
load to the GGUF type (gguf's own quantizer) and served by the quantized kernels:

- a layer equals F.linear on `gguf.quants.dequantize(gguf.quants.quantize(W))` in float32,
  on the quantized path (few rows) and the dense one (many), odd shapes, with a bias; a
  layer whose input width is not whole blocks keeps its weight;
- a tiny llama (untied) and qwen2 (tied head, q/k/v biases) served in float32 give the
  same greedy tokens as transformers on the same directory with every nn.Linear weight
  so rounded (the down projections, 172 wide, stay dense in both);
- the server arguments refuse the combinations that cannot work, naming them.
"""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from runner_steps import greedy_steps, hf_greedy, make_runner
from transformers import AutoModelForCausalLM

from tandem.entrypoints.sglang_routes import model_info
from tandem.kernels import cpu as cpu_kernels
from tandem.layers.linear import ColumnParallelLinear, LinearBase, MergedColumnParallelLinear, RowParallelLinear
from tandem.server_args import ServerArgs
from tandem.tools.make_tiny_model import make_tiny_model

METHODS = ["q8_0", "q4_0", "q4_1"]
HAS_KERNELS = cpu_kernels.load() is not None


def rounded(weight: torch.Tensor, method: str) -> torch.Tensor:
    """gguf's quantize then dequantize of `weight` (float32), the reference."""
    qtype = gguf.GGMLQuantizationType[method.upper()]
    blocks = gguf.quants.quantize(weight.float().numpy(), qtype)
    return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(blocks, qtype)))


def filled(layer: LinearBase, seed: int) -> LinearBase:
    g = torch.Generator().manual_seed(seed)
    layer.weight.data.copy_(torch.randn(layer.weight.shape, generator=g))
    if layer.bias is not None:
        layer.bias.data.copy_(torch.randn(layer.bias.shape, generator=g))
    return layer


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "make",
    [
        lambda: ColumnParallelLinear(96, 37, bias=True),
        lambda: RowParallelLinear(160, 29, bias=True),
        lambda: MergedColumnParallelLinear(64, [19, 23]),
    ],
    ids=["column-bias", "row-bias", "merged"],
)
def test_layer_equals_linear_on_gguf_rounded_weights(method, make):
    layer = filled(make(), seed=3)
    weight = rounded(layer.weight.data, method)
    bias = None if layer.bias is None else layer.bias.data.clone()
    layer.process_weights_after_loading("auto", quantization=method)
    assert layer.quantized_at_load == method
    assert (layer.quant_kernel is not None) == HAS_KERNELS
    for rows in (1, 3, 17):  # 1 and 3: the quantized kernel; 17: the dense one
        x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows))
        ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
        got = layer(x)
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, atol=2e-6 * ref.abs().max().item(), rtol=0)


def test_layer_of_partial_blocks_stays_dense():
    layer = filled(ColumnParallelLinear(40, 24), seed=1)  # 40 columns: not whole blocks of 32
    weight = layer.weight.data.clone()
    layer.process_weights_after_loading("torch", quantization="q4_0")
    assert layer.quantized_at_load is None and layer.quant_kernel is None
    assert torch.equal(layer.weight.data, weight)


def test_bfloat16_weight_becomes_the_rounded_values():
    layer = ColumnParallelLinear(64, 16)
    layer.weight.data = torch.randn(16, 64, generator=torch.Generator().manual_seed(0)).bfloat16()
    expected = rounded(layer.weight.data, "q8_0").bfloat16()
    layer.process_weights_after_loading("torch", quantization="q8_0")  # torch: the weight stays in place
    assert torch.equal(layer.weight.data, expected)


# ---- model level: Tandem against transformers on the rounded weights ----------------------

PROMPTS = [[1, 5, 9, 13, 2, 7, 7, 3, 11], [1, 2], list(range(1, 40))]
STEPS = 16


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ("llama", "qwen2")}


@torch.inference_mode()
def rounded_transformers(model_dir, method: str):
    """transformers' model with every nn.Linear weight rounded in place (a tied head's is
    the embedding's, as in Tandem); widths that are not whole blocks stay as they are."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # greedy_steps does not stop at EOS either
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
            module.weight.data.copy_(rounded(module.weight.data, method))
    return model


@pytest.mark.parametrize("method", ["q8_0", "q4_0"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_tokens_equal_transformers_on_rounded_weights(model_dirs, arch, method, caplog):
    with caplog.at_level(logging.INFO, logger="tandem.models"):
        runner = make_runner(model_dirs[arch], dtype="float32", quantization=method)
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"--quantization {method}")]
    assert line.endswith("dense (input width not a multiple of 32): model.layers.*.mlp.down_proj")
    linears = [m for m in runner.model.modules() if isinstance(m, LinearBase)]
    assert sum(m.quant_kernel is not None for m in linears) == (len(linears) - 3 if HAS_KERNELS else 0)
    # every quantized kernel's tensors were moved into one huge-page arena (place_in_huge_pages)
    kernels = [m.quant_kernel for m in linears if m.quant_kernel is not None]
    storages = {t.untyped_storage().data_ptr() for k in kernels for t in (k.q, k.scale, k.mn)}
    assert len(storages) == (1 if kernels else 0)
    ids, logits = greedy_steps(runner, PROMPTS, STEPS)  # decode: 3 rows, on the quantized kernel
    model = rounded_transformers(model_dirs[arch], method)
    for i, prompt in enumerate(PROMPTS):
        ref_ids, ref_logits = hf_greedy(model, prompt, STEPS)
        ref_first = ref_logits[0]
        assert ids[i] == ref_ids, f"prompt {i}"
        torch.testing.assert_close(logits[0][i], ref_first, atol=1e-4 * ref_first.abs().max().item(), rtol=0)


# ---- server arguments ----------------------------------------------------------------------


def _parse(*argv: str) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(["--model-path", "/m", "--device", "cpu", *argv]))


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["--model-path", "/models/m.Q4_K_M.gguf", "--quantization", "q8_0"],
            "--quantization q8_0 quantizes a Hugging Face checkpoint at load, but --model-path "
            "'/models/m.Q4_K_M.gguf' is a GGUF model (served with its own blocks: drop --quantization q8_0)",
        ),
        (
            ["--quantization", "q4_0", "--linear-backend", "torch"],
            "--quantization q4_0 with --linear-backend torch: only the auto backend has the quantized kernels",
        ),
        (
            ["--quantization", "q4_1", "--device", "cuda", "--chunked-prefill-size", "-1"],
            "--quantization q4_1 with --device cuda: the quantized kernels are CPU-only",
        ),
        (
            ["--quantization", "awq"],
            "--quantization awq: not supported; the methods built are gguf (a GGUF "
            "model's own blocks; implied by a GGUF path) and q8_0, q4_0, q4_1 "
            "(a Hugging Face checkpoint quantized at load)",
        ),
        (["--quantization", "fp8"], "--quantization fp8: not supported;"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(argv, message):
    with pytest.raises(ValueError) as e:
        _parse(*argv).validate()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


@pytest.mark.parametrize("method", METHODS)
def test_methods_pass_and_are_reported(method):
    args = _parse("--quantization", method, "--load-format", "dummy")
    args.validate()
    assert args.to_dict()["quantization"] == method  # /server_info
    assert model_info(args, SimpleNamespace())["quantization"] == method
    assert "quantization" not in model_info(_parse(), SimpleNamespace())
