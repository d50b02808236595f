"""The model with `--attention-backend triton` (Triton's interpreter on CPU) gives the
torch-native backend's logits and greedy tokens: ragged prompts, one-token prompts, and
a chunked prefill; the registry refuses unknown names."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (pip install triton): the Triton backend is untested")

from runner_steps import greedy_steps, make_runner  # noqa: E402

from tandem.layers.attention.registry import create_attention_backend  # noqa: E402
from tandem.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPTS = [
    [1, 5, 9, 13, 2, 7, 7, 3, 11],
    [1],
    [1, 4, 4, 4, 8, 20, 30, 31, 40, 41, 50, 60, 61, 62, 63, 64, 70, 71, 72, 73, 74, 75, 76, 77, 78, 79, 80],
]


def test_triton_model_matches_torch_native(tiny_llama_dir):
    native = make_runner(tiny_llama_dir, device=DEVICE, dtype="float32", attention_backend="torch_native")
    triton_runner = make_runner(
        tiny_llama_dir, device=DEVICE, dtype="float32", attention_backend="triton", disable_cuda_graph=True
    )
    assert isinstance(triton_runner.attn_backend, TritonAttnBackend)
    ids_a, logits_a = greedy_steps(native, PROMPTS, 3)
    ids_b, logits_b = greedy_steps(triton_runner, PROMPTS, 3)
    assert ids_a == ids_b
    for a, b in zip(logits_a, logits_b):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # Chunked prefill (8-token chunks over the cached KV of earlier chunks) agrees too.
    ids_c, logits_c = greedy_steps(triton_runner, PROMPTS, 1, chunk=8)
    assert [ids[:1] for ids in ids_a] == ids_c
    torch.testing.assert_close(logits_c[0], logits_a[0], atol=1e-4, rtol=1e-4)


def test_registry_refuses_unknown_backend():
    with pytest.raises(ValueError, match="--attention-backend: unknown backend 'flashinfer'"):
        create_attention_backend("flashinfer", None, None, 4, 16)


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    from tandem.mem_cache.memory_pool import ReqToTokenPool

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        create_attention_backend("triton", ReqToTokenPool(2, 8, "cpu"), None, 4, 16)
