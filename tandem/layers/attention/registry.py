"""`--attention-backend`: SGLang's backend names mapped to Tandem's implementations
(`ServerArgs` picks the default: triton on CUDA, torch_native elsewhere).

The Triton backend is imported only when chosen, so that a machine without Triton runs
the torch-native one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tandem.layers.attention.base import AttentionBackend
from tandem.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


def _torch_native(req_to_token_pool, token_to_kv_pool, num_heads, head_dim, enable_torch_compile) -> AttentionBackend:
    from tandem.layers.attention.torch_native import TorchNativeAttnBackend

    return TorchNativeAttnBackend(req_to_token_pool, token_to_kv_pool, enable_torch_compile, num_heads)


def _triton(req_to_token_pool, token_to_kv_pool, num_heads, head_dim, enable_torch_compile) -> AttentionBackend:
    """Its kernels are compiled already: `--enable-torch-compile` changes nothing here."""
    if req_to_token_pool.req_to_token.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            "--attention-backend triton: the kernels need CUDA, or on CPU Triton's interpreter "
            "(TRITON_INTERPRET=1, for tests)"
        )
    from tandem.layers.attention.triton_backend import TritonAttnBackend

    return TritonAttnBackend(req_to_token_pool, token_to_kv_pool, num_heads, head_dim)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {
    "torch_native": _torch_native,
    "triton": _triton,
}


def torch_compile_note(backend: AttentionBackend, name: str) -> str:
    """`--enable-torch-compile`'s one log line: what it compiles, or why it compiles nothing."""
    compiled = getattr(backend, "compiled_decode", None)
    if compiled is not None:
        return (
            "--enable-torch-compile: torch_native's decode attention (paged_decode) is compiled by "
            "torch.compile (Inductor) at start; nothing else is compiled"
        )
    if getattr(backend, "decode_kernel", None) is not None:
        return (
            "--enable-torch-compile has no effect here: decode attention runs Tandem's C++ CPU kernel "
            "(TANDEM_DISABLE_CPU_KERNELS=1 runs torch_native's PyTorch decode, compiled)"
        )
    return f"--enable-torch-compile has no effect here: --attention-backend {name}'s kernels are compiled already"


def create_attention_backend(
    name: str,
    req_to_token_pool: ReqToTokenPool,
    token_to_kv_pool: TokenToKVPool,
    num_heads: int,
    head_dim: int,
    enable_torch_compile: bool = False,
) -> AttentionBackend:
    """The backend `name` for this rank's `num_heads` query heads of `head_dim`;
    `enable_torch_compile` (`--enable-torch-compile`) compiles torch_native's decode."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend: unknown backend {name!r}; choose from {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](req_to_token_pool, token_to_kv_pool, num_heads, head_dim, enable_torch_compile)
