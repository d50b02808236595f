"""Phi-3 (`Phi3ForCausalLM`): Llama's layer (no biases, SiLU-gated MLP) with q/k/v fused
in the checkpoint as `self_attn.qkv_proj` and gate/up as `mlp.gate_up_proj`, and the
long-context RoPE of the 128k models (`longrope`, tandem/layers/rotary.py; the 4k models
use plain RoPE).

The fused checkpoint tensors load into Tandem's fused parameters part by part: each is
cut into its q, k, v (gate, up) rows, and each part goes through the parameter's
`weight_loader` under its shard id, as separate q/k/v tensors would. Under tensor
parallelism every rank so takes its own heads of q, of k and of v (and its own share of
gate and of up), not a slice of the raw concatenation, and reads only those rows.

The config's `sliding_window` (Phi-3-mini-4k's 2047) applies on every layer, as in
transformers: the query at p sees the keys at (p - window, p]. A `partial_rotary_factor`
below 1 (Phi-4-mini's 0.75) rotates the first `head_dim * factor` of each head only
(`base.rotary_dim_of`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tandem.layers.weight_shard import CheckpointTensor
from tandem.models.base import CausalLM, LayerOptions, head_dim_of


class RowRange:
    """Rows `[start, start + length)` of a checkpoint tensor (a torch.Tensor or a
    safetensors slice), indexed as the tensor itself is by `layers/weight_shard.py`:
    reading a slice of it reads only those rows of the file."""

    def __init__(self, tensor: CheckpointTensor, start: int, length: int):
        self.tensor, self.start, self.length = tensor, start, length

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        if index and index[0] is Ellipsis:
            index = (slice(None),) + index
        first, rest = (index[0], index[1:]) if index else (slice(None), ())
        lo, hi, step = first.indices(self.length)
        if step != 1:
            raise ValueError("RowRange takes contiguous row slices only")
        return self.tensor[(slice(self.start + lo, self.start + hi),) + rest]


def split_fused(config, weights: Iterable[tuple[str, CheckpointTensor]]) -> Iterator[tuple[str, CheckpointTensor]]:
    """The checkpoint's tensors with each fused `qkv_proj` / `gate_up_proj` weight (or
    bias) replaced by its parts under the unfused names (`q_proj`, ..., `up_proj`)."""
    head_dim = head_dim_of(config)
    q_size = config.num_attention_heads * head_dim
    kv_size = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    inter = config.intermediate_size
    fused = {
        "self_attn.qkv_proj": [("q_proj", q_size), ("k_proj", kv_size), ("v_proj", kv_size)],
        "mlp.gate_up_proj": [("gate_proj", inter), ("up_proj", inter)],
    }
    for name, tensor in weights:
        for parent_fused, parts in fused.items():
            marker = f".{parent_fused}."
            if marker in name:
                parent, _ = parent_fused.split(".")
                start = 0
                for part, size in parts:
                    yield name.replace(marker, f".{parent}.{part}."), RowRange(tensor, start, size)
                    start += size
                break
        else:
            yield name, tensor


class Phi3ForCausalLM(CausalLM):
    @classmethod
    def layer_options(cls, config, layer_id: int) -> LayerOptions:
        return LayerOptions(sliding_window=int(getattr(config, "sliding_window", None) or 0))

    def __init__(self, config, tp_rank: int = 0, tp_size: int = 1):
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"Phi-3 with hidden_act {act!r} is not supported; supported: 'silu'")
        super().__init__(config, tp_rank, tp_size)

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]], require_all: bool = True) -> None:
        super().load_weights(split_fused(self.config, weights), require_all)


EntryClass = [Phi3ForCausalLM]
