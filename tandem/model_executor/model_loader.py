"""Reads a Hugging Face model directory: config and safetensors weights, tensor by tensor
(or, with --load-format dummy, fills the weights with seeded random values instead).

Weights are yielded as safetensors slices, read lazily: each parameter's weight loader
reads only the rows its tensor-parallel rank owns (`tandem.layers.weight_shard`).
"""

from __future__ import annotations

import glob
import os
import zlib
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig

from tandem.layers.weight_shard import CheckpointTensor


def load_config(model_path: str):
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"--model-path: {model_path!r} has no config.json (a Hugging Face model directory is expected)")
    return AutoConfig.from_pretrained(model_path)


def iterate_weights(model_path: str,
                    show_progress: bool = True) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield (name, lazy slice) from every *.safetensors file, with a progress bar over files."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"--model-path: no *.safetensors files in {model_path!r}")
    for path in tqdm(files, desc="Loading safetensors shards", disable=not show_progress, unit="file"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


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
                -DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
            tensor.copy_(values)
