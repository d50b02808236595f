"""Reads a Hugging Face model directory: config and safetensors weights, tensor by tensor
(or, with --load-format dummy, fills the weights with seeded random values instead)."""

from __future__ import annotations

import glob
import os
from typing import Iterator

import torch
from safetensors import safe_open
from tqdm import tqdm
from transformers import AutoConfig


def load_config(model_path: str):
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ValueError(f"--model-path: {model_path!r} has no config.json (a Hugging Face model directory is expected)")
    return AutoConfig.from_pretrained(model_path)


def iterate_weights(model_path: str, show_progress: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from every *.safetensors file, with a progress bar over files."""
    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise ValueError(f"--model-path: no *.safetensors files in {model_path!r}")
    for path in tqdm(files, desc="Loading safetensors shards", disable=not show_progress, unit="file"):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# --load-format dummy draws every weight from U(-DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE), as SGLang does.
DUMMY_WEIGHT_RANGE = 1e-3


@torch.no_grad()
def initialize_dummy_weights(model: torch.nn.Module, seed: int) -> None:
    """Random weights without weight files (benchmarks and tests of a model's shape)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for tensor in model.parameters():  # not the buffers: RoPE tables stay computed
        if tensor.is_floating_point():
            values = torch.empty(tensor.shape, dtype=torch.float32).uniform_(
                -DUMMY_WEIGHT_RANGE, DUMMY_WEIGHT_RANGE, generator=generator)
            tensor.copy_(values)
