"""`--enable-torch-compile` says in one log line what it compiles, or why it compiles
nothing (docs/api.md: on CPU with Tandem's C++ decode kernel, and with
--attention-backend triton, it has no effect)."""

from __future__ import annotations

import logging

import pytest
from runner_steps import make_runner

from tandem.kernels import cpu as cpu_kernels
from tandem.layers.attention.torch_native import TorchNativeAttnBackend

LOGGER = "tandem.model_executor.model_runner"


def compile_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "--enable-torch-compile" in r.getMessage()]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="Tandem's C++ CPU kernels cannot be built here")
def test_cpu_decode_kernel_in_use_says_nothing_is_compiled(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = make_runner(tiny_llama_dir, enable_torch_compile=True, attention_backend="torch_native")
    assert runner.attn_backend.compiled_decode is None
    assert compile_lines(caplog) == [
        "--enable-torch-compile has no effect here: decode attention runs Tandem's C++ CPU kernel "
        "(TANDEM_DISABLE_CPU_KERNELS=1 runs torch_native's PyTorch decode, compiled)"
    ]


def test_triton_backend_says_nothing_is_compiled(tiny_llama_dir, caplog):
    pytest.importorskip("triton", reason="triton is not installed")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        make_runner(tiny_llama_dir, enable_torch_compile=True, attention_backend="triton")
    assert compile_lines(caplog) == [
        "--enable-torch-compile has no effect here: --attention-backend triton's kernels are compiled already"
    ]


def test_compiled_decode_says_what_is_compiled(tiny_llama_dir, caplog, monkeypatch):
    """Without the C++ kernel the decode attention is compiled (the compile itself, 5-40 s,
    is tested in test_torch_native_attention.py; skipped here)."""
    monkeypatch.setattr(TorchNativeAttnBackend, "_cpu_attention_ops", staticmethod(lambda pool, heads: None))
    monkeypatch.setattr(TorchNativeAttnBackend, "_compile_decode", lambda self, heads: None)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        runner = make_runner(tiny_llama_dir, enable_torch_compile=True, attention_backend="torch_native")
    assert runner.attn_backend.compiled_decode is not None
    assert compile_lines(caplog) == [
        "--enable-torch-compile: torch_native's decode attention (paged_decode) is compiled by torch.compile "
        "(Inductor) at start; nothing else is compiled"
    ]


def test_no_line_without_the_flag(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger=LOGGER):
        make_runner(tiny_llama_dir, attention_backend="torch_native")
    assert compile_lines(caplog) == []
