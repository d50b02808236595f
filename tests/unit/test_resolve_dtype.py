"""`--dtype auto`: bfloat16 on CPU only for a half-precision checkpoint on a CPU with native
bfloat16; float32 checkpoints stay float32; explicit dtypes are taken as given."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tandem.model_executor.model_runner import resolve_dtype


@pytest.mark.parametrize(
    "config_dtype, native, expected",
    [
        ("bfloat16", True, torch.bfloat16),
        ("float16", True, torch.bfloat16),
        (torch.bfloat16, True, torch.bfloat16),
        ("bfloat16", False, torch.float32),
        ("float32", True, torch.float32),
        (None, True, torch.float32),
    ],
)
def test_auto_on_cpu(config_dtype, native, expected):
    config = SimpleNamespace(torch_dtype=config_dtype)
    assert resolve_dtype("auto", config, "cpu", native_bf16=native) == expected


def test_explicit_dtype_wins():
    config = SimpleNamespace(torch_dtype="bfloat16")
    assert resolve_dtype("float32", config, "cpu", native_bf16=True) == torch.float32
    assert resolve_dtype("bfloat16", SimpleNamespace(torch_dtype="float32"), "cpu", native_bf16=False) == torch.bfloat16


def test_auto_on_gpu_is_the_half_dtype():
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="float16"), "cuda") == torch.float16
    assert resolve_dtype("auto", SimpleNamespace(torch_dtype="float32"), "cuda") == torch.bfloat16
