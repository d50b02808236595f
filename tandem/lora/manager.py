"""`LoraManager`: one rank's LoRA adapters: those loaded (host memory, at most
`--max-loaded-loras`), the slot pool they are copied into when a batch uses them
(`--max-loras-per-batch` slots, least recently used evicted), and the per-forward
`LoraBatch`.

Adapters are known inside the server by a load id (`uid`), never reused: a name unloaded
and loaded again gets a new one, so a request or a cached prefix of the old adapter can
never reach the new one. Every TP rank loads the same adapters in the same order, so
the ids agree. Slots are assigned on the forward thread when a batch runs
(`batch_for`), so a slot is rewritten only after every earlier forward has read it; the
scheduler keeps each batch, and the running set, within the slots
(`BatchFormer`'s adapter limit).
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch
from torch import nn

from tandem.lora.adapter import SUPPORTED_MODULES, LoraAdapter, config_target_modules, load_adapter, read_config
from tandem.lora.batch import LoraBatch
from tandem.lora.pool import LoraPool

logger = logging.getLogger(__name__)


def parse_lora_paths(values: list[str] | None) -> dict[str, str]:
    """--lora-paths: `name=path`, a bare `path` (named by itself) or SGLang's JSON form
    `{"lora_name": ..., "lora_path": ...}`; name -> path. ValueError naming a bad one."""
    import json

    out: dict[str, str] = {}
    for value in values or []:
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["lora_name"], spec["lora_path"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--lora-paths: {value!r} is not {{'lora_name': ..., 'lora_path': ...}}") from None
        else:
            name, sep, path = value.partition("=")
            name, path = (name, path) if sep else (value, value)
        if not name or not path:
            raise ValueError(f"--lora-paths: {value!r} has an empty name or path")
        if name in out:
            raise ValueError(f"--lora-paths: adapter name {name!r} is given twice")
        out[name] = path
    return out


def parse_target_modules(values: list[str] | None) -> set[str] | None:
    """--lora-target-modules (PEFT names, or `all`); None when not given."""
    if not values:
        return None
    if "all" in values:
        return set(SUPPORTED_MODULES)
    unknown = sorted(set(values) - set(SUPPORTED_MODULES))
    if unknown:
        raise ValueError(f"--lora-target-modules: {', '.join(unknown)} not supported ({', '.join(SUPPORTED_MODULES)})")
    return set(values)


class LoraManager:
    def __init__(self, model: nn.Module, server_args, dtype: torch.dtype, device: str):
        self.dtype, self.device = dtype, device
        initial = parse_lora_paths(server_args.lora_paths)
        configs = {name: read_config(path, name) for name, path in initial.items()}
        targets = parse_target_modules(server_args.lora_target_modules)
        if targets is None:
            targets = set().union(*(config_target_modules(c) for c in configs.values())) if configs else None
        max_rank = server_args.max_lora_rank or max((int(c.get("r", 0)) for c in configs.values()), default=None)
        if targets is None or max_rank is None:
            raise ValueError("--enable-lora without --lora-paths needs --max-lora-rank and --lora-target-modules")
        self.max_loaded = server_args.max_loaded_loras
        self.pool = LoraPool(model, targets, server_args.max_loras_per_batch, max_rank, dtype, device)
        self.adapters: dict[int, LoraAdapter] = {}  # uid -> adapter
        self.uids: dict[str, int] = {}  # name -> uid of the loaded adapter
        self._next_uid = 0
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # uid -> slot, least recently used first
        for name, path in initial.items():
            self.load(name, path)

    def load(self, name: str, path: str) -> LoraAdapter:
        """Read adapter `name` from `path`; ValueError (naming what is wrong) leaves the
        loaded ones as they were."""
        if name in self.uids:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        if self.max_loaded is not None and len(self.uids) >= self.max_loaded:
            raise ValueError(f"cannot load LoRA adapter {name!r}: --max-loaded-loras {self.max_loaded} are loaded")
        adapter = load_adapter(name, path, self.pool.max_rank, self.pool.resolve, self.pool.shapes)
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        self.adapters[uid], self.uids[name] = adapter, uid
        logger.info(
            "loaded LoRA adapter %s (rank %d, %s) from %s", name, adapter.rank, sorted(adapter.target_modules), path
        )
        return adapter

    def unload(self, name: str) -> None:
        if name not in self.uids:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")
        uid = self.uids.pop(name)
        del self.adapters[uid]
        self.slot_of.pop(uid, None)

    def loaded(self) -> dict[str, str]:
        """name -> path of the loaded adapters, in load order."""
        return {name: self.adapters[uid].path for name, uid in self.uids.items()}

    def slots_for(self, uids: list[int | None]) -> list[int]:
        """The slot of each request's adapter (-1: none), copying adapters not in a slot
        into the least recently used slots that this batch does not use."""
        wanted = {u for u in uids if u is not None}
        if len(wanted) > self.pool.num_slots:
            raise RuntimeError(
                f"a batch uses {len(wanted)} LoRA adapters; --max-loras-per-batch is {self.pool.num_slots}"
            )
        for uid in wanted:
            if uid in self.slot_of:
                self.slot_of.move_to_end(uid)
        for uid in wanted - set(self.slot_of):
            taken = set(self.slot_of.values())
            free = [s for s in range(self.pool.num_slots) if s not in taken]
            if free:
                slot = free[0]
            else:
                victim = next(u for u in self.slot_of if u not in wanted)
                slot = self.slot_of.pop(victim)
            self.pool.write(slot, self.adapters[uid])
            self.slot_of[uid] = slot
        return [-1 if u is None else self.slot_of[u] for u in uids]

    def batch_for(self, uids: list[int | None] | None, extend_lens: list[int]) -> LoraBatch | None:
        """The forward's `LoraBatch` for requests using adapters `uids` (None: none)."""
        if uids is None or all(u is None for u in uids):
            return None
        return LoraBatch.build(self.slots_for(uids), extend_lens, self.pool.num_slots, self.dtype, self.device)
