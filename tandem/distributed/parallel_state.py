"""The process groups of one tensor-parallel (TP) group.

A TP group is one `torch.distributed` world: scheduler process TP k is rank k. It has
two groups over the same ranks:
- the world's default group (NCCL on CUDA, gloo on CPU) carries tensors: the
  all-reduce after each row-parallel layer and the all-gather of the logits
  (communication_op.py), and the KV pool size's minimum at start-up.
- `TpGroup.cpu_group`, always gloo, carries Python objects: rank 0's inputs every step
  (the scheduler's I/O object). NCCL cannot carry objects without a device round trip,
  and a group of its own keeps the scheduler's collectives from interleaving with the
  forward's when the two run on different threads (collectives on one group must be
  issued in the same order on every rank).
On CUDA each rank uses its own device (placement.py: `--base-gpu-id` + its local
index). Where the ranks meet and which run on which node: placement.py.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TpGroup:
    """This process's rank in its TP group, and the group's CPU (gloo) process group
    (None when the group has one rank: every collective is then the identity)."""

    rank: int = 0
    size: int = 1
    cpu_group: Any = None

    @property
    def is_first_rank(self) -> bool:
        """Rank 0 owns the ZMQ sockets and decides; the others follow its broadcasts."""
        return self.rank == 0

    def broadcast_objects(self, objs: list | None) -> list:
        """Rank 0's `objs` (picklable), returned on every rank; other ranks pass None."""
        if self.size == 1:
            return objs
        box = [objs if self.is_first_rank else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def init_tp_group(
    tp_rank: int, tp_size: int, device: str, init_method: str, gpu_id: int = 0, timeout_s: float | None = None
) -> TpGroup:
    """Join the TP group (blocks until every rank has joined) and select this rank's
    device (`gpu_id` on CUDA). With one rank no process group is made.

    `timeout_s` bounds the rendezvous and every collective (torch's default: 30 min): a
    peer that died is noticed at once (its connections close), one that hangs or whose
    network is gone after this long."""
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(gpu_id)
        backend = "nccl"
    if tp_size == 1:
        return TpGroup()
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s is not None else None
    dist.init_process_group(backend, init_method=init_method, world_size=tp_size, rank=tp_rank, timeout=timeout)
    # NOTE: a gloo group of its own even when the default group is gloo (see above).
    return TpGroup(rank=tp_rank, size=tp_size, cpu_group=dist.new_group(backend="gloo", timeout=timeout))


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc` is a collective failing because another rank is gone: its process or
    node died (the connection closed) or stopped answering (a timeout). gloo and NCCL
    raise RuntimeError with these words; nothing finer is exposed."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(
        words in text
        for words in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "Timed out",
            "timed out",
            "NCCL communicator was aborted",
        )
    )
