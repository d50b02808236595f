"""Reads a model: a Hugging Face directory (config and safetensors weights, tensor by
tensor) or GGUF file(s) (`gguf_loader`: config, tokenizer and weights from the metadata
and blocks), or, with --load-format dummy, fills the weights with seeded random values.

Weights are yielded as lazy slices (safetensors slices or `GGUFWeight`s): each
parameter's weight loader reads only the rows its tensor-parallel rank owns
(`tandem.layers.weight_shard`).
"""

from __future__ import annotations

import glob
import os
import zlib
from collections.abc import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from tandem.layers.weight_shard import CheckpointTensor
from tandem.model_executor.gguf_loader import gguf_model_dir, is_gguf_path, iterate_gguf_weights


def load_config(model_path: str):
    """The model's Hugging Face config; ValueError naming what is wrong with the path."""
    if is_gguf_path(model_path):
        return AutoConfig.from_pretrained(gguf_model_dir(model_path, need_tokenizer=False))
    if not os.path.isdir(model_path):
        raise ValueError(
            f"--model-path: {model_path!r} is neither a model directory (with a config.json) nor a .gguf file"
        )
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(
            f"--model-path: {model_path!r} has no config.json (a Hugging Face model directory is expected)"
        )
    return AutoConfig.from_pretrained(model_path)


def iterate_weights(model_path: str, show_progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, lazy slice) from every *.safetensors file, with a progress bar over files
    (over tensors for GGUF)."""
    if is_gguf_path(model_path):
        yield from iterate_gguf_weights(model_path, show_progress=show_progress)
        return
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"--model-path: no *.safetensors files in {model_path!r}")
    for path in tqdm(files, desc="Loading safetensors shards", disable=not show_progress, unit="file"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def check_model(server_args) -> None:
    """Read what the servers will load before starting them, so that a bad model path or
    file stops the start with one line (ValueError) rather than a subprocess' traceback:
    the config, and a GGUF file's tokenizer (built once and cached); and a `--kv-cache-dtype`
    that cannot run beside the activations' dtype."""
    from tandem.model_executor.model_runner import resolve_dtype, resolve_kv_cache_dtype

    config = load_config(server_args.model_path)
    if not server_args.skip_tokenizer_init and is_gguf_path(server_args.tokenizer_path):
        gguf_model_dir(server_args.tokenizer_path, need_tokenizer=True)
    dtype = resolve_dtype(server_args.dtype, config, server_args.device)
    resolve_kv_cache_dtype(server_args.kv_cache_dtype, dtype, server_args.device)


# --load-format dummy draws every weight from U(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE), as SGLang does.
DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights without weight files (benchmarks and tests of a model's shape).
    Each parameter draws from its own generator, seeded by `seed` and its name, so the
    parameters that tensor parallelism replicates are equal on every rank."""
    for name, tensor in model.named_parameters():  # not the buffers: RoPE tables stay computed
        if tensor.is_floating_point():
            name_seed = (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63
            generator = torch.Generator(device="cpu").manual_seed(name_seed)
            values = torch.empty(tensor.shape, dtype=torch.float32).uniform_(
                -DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator
            )
            tensor.copy_(values)
