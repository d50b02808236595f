"""The slot pool: every LoRA target layer's A and B weights for `--max-loras-per-batch`
adapters at once, in the layout the batched matmuls read (`tandem.lora.batch`).

Per target linear layer (`LinearBase.lora_slots`), with P fused parts (q/k/v: 3,
gate/up: 2, else 1) and R = --max-lora-rank:
  a [slots, P*R, in]   part p's A in rows [p*R, p*R + r)
  b [slots, P*R, out]  part p's B (transposed) in rows [p*R, p*R + r), its output columns:
                       block diagonal, so one matmul gives every part's delta; and
                       `b.view(slots * P*R, out)` is every slot's at once (a view)
An adapter of rank r < R, or lacking a part, leaves zeros there, which add nothing.

Tensor parallelism: each rank keeps its share, split as the base layer is. A column-
parallel layer (q/k/v, gate/up) holds the rows of B its output has (A whole); a row-
parallel one (o, down) the columns of A its input has (B whole), and its delta is
all-reduced with the base output (`RowParallelLinear.forward`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from tandem.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear
from tandem.lora.adapter import LoraAdapter, LoraTarget

# PEFT module name -> (the model's layer under `model.layers.<i>.`, part of its output).
MODULE_LAYERS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_MODULE_PATH = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp)\.(\w+)$")


def whole_shapes(config) -> dict[str, tuple[int, int]]:
    """(out, in) of each PEFT module's whole (unsplit) base matrix in a decoder layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, inter = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * head_dim
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head_dim
    return {
        "q_proj": (q, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, q),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
    }


@dataclass
class LoraLayerSlots:
    """One target layer's weights of every slot, and where this rank's share of each
    part lies in the whole (checkpoint) matrices."""

    a: torch.Tensor  # [slots, P*R, in]
    b: torch.Tensor  # [slots, P*R, out]: B transposed
    rank: int  # R
    out_offsets: list[int]  # part p's rows in this rank's output
    out_sizes: list[int]
    out_starts: list[int]  # ... read from row out_starts[p] of the part's whole B
    in_start: int  # this rank's input columns of the whole A (row-parallel), else 0

    def write(self, slot: int, part: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """Part `part` of slot `slot` := this rank's share of whole A [r, in], scaled B [out, r]."""
        r, size, lo = a.shape[0], self.out_sizes[part], part * self.rank
        cols = self.a.shape[2]
        self.a[slot, lo : lo + r].copy_(a[:, self.in_start : self.in_start + cols])
        rows = b[self.out_starts[part] : self.out_starts[part] + size]
        self.b[slot, lo : lo + r, self.out_offsets[part] : self.out_offsets[part] + size].copy_(rows.t())


def _parts(layer: LinearBase) -> tuple[list[int], list[int], list[int], int]:
    """(out offsets, out sizes, whole-matrix row starts, input column start) of a layer."""
    if isinstance(layer, MergedColumnParallelLinear):
        sizes = list(layer.shard_sizes)
        return [sum(sizes[:p]) for p in range(len(sizes))], sizes, list(layer.shard_starts), 0
    out = layer.out_features
    if isinstance(layer, RowParallelLinear):
        return [0], [out], [0], layer.tp_rank * layer.in_features
    return [0], [out], [layer.tp_rank * out], 0


class LoraPool:
    """The slots of `num_slots` adapters over the model's target layers: those of
    `target_modules` (PEFT names) that the model's decoder layers have."""

    def __init__(self, model: nn.Module, target_modules: set[str], num_slots: int, max_rank: int, dtype, device):
        self.num_slots, self.max_rank = num_slots, max_rank
        self.target_modules = set(target_modules)
        shapes = whole_shapes(model.config)
        modules = dict(model.named_modules())
        self.part_of: dict[tuple[int, str], LoraTarget] = {}  # (layer index, PEFT module) -> target
        self.shapes: dict[LoraTarget, tuple[int, int]] = {}
        self.slots: dict[str, LoraLayerSlots] = {}
        for i in range(len(model.model.layers)):
            for module in sorted(self.target_modules):
                path, part = MODULE_LAYERS[module]
                name = f"model.layers.{i}.{path}"
                layer = modules.get(name)
                if not isinstance(layer, LinearBase):
                    continue
                target = LoraTarget(name, part)
                self.part_of[(i, module)], self.shapes[target] = target, shapes[module]
                if name not in self.slots:
                    self.slots[name] = self._layer_slots(layer, dtype, device)
        self.attach(model)

    def _layer_slots(self, layer: LinearBase, dtype, device) -> LoraLayerSlots:
        offsets, sizes, starts, in_start = _parts(layer)
        width = len(sizes) * self.max_rank
        return LoraLayerSlots(
            torch.zeros(self.num_slots, width, layer.in_features, dtype=dtype, device=device),
            torch.zeros(self.num_slots, width, layer.out_features, dtype=dtype, device=device),
            self.max_rank,
            offsets,
            sizes,
            starts,
            in_start,
        )

    def attach(self, model: nn.Module) -> None:
        """Point `model`'s target layers at the slots (again after a weight update rebuilt it)."""
        modules = dict(model.named_modules())
        for name, slots in self.slots.items():
            modules[name].lora_slots = slots

    def resolve(self, module_path: str) -> LoraTarget | None:
        """The target of a PEFT module path (`model.layers.3.self_attn.q_proj`), or None."""
        m = _MODULE_PATH.search(module_path)
        if m is None or MODULE_LAYERS.get(m.group(3), ("",))[0].split(".")[0] != m.group(2):
            return None
        return self.part_of.get((int(m.group(1)), m.group(3)))

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` into `slot` (zeros where it has no weights)."""
        for slots in self.slots.values():
            slots.a[slot].zero_()
            slots.b[slot].zero_()
        for target, (a, b) in adapter.weights.items():
            self.slots[target.layer].write(slot, target.part, a, b)
