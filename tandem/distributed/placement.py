"""Where the scheduler ranks run: which ranks this node starts, their process names,
devices and the rendezvous of their TP group.

`--dp-size M` makes M replicas (data parallelism), each a TP group of `--tp-size` ranks
that is its own `torch.distributed` world, meeting at its own rendezvous file in the
server's private ipc directory (`tp-rendezvous-dp{k}`: distinct per replica, no port).
`--nnodes N` spreads one TP group over N machines: node n runs TP ranks
`n * tp_size / N` to `(n + 1) * tp_size / N - 1`, and they meet over TCP at
`--dist-init-addr` (rank 0, on node 0, hosts the store there).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tandem.server_args import ServerArgs

# Name of a replica's rendezvous file inside the server's private ipc directory.
RENDEZVOUS_FILE = "tp-rendezvous"


@dataclass(frozen=True)
class SchedulerRank:
    """One scheduler process: its TP rank, and its DP rank when there are replicas."""

    tp_rank: int
    dp_rank: int | None = None

    @property
    def name(self) -> str:
        """`scheduler_TP1`, or `scheduler_DP1_TP0` under --dp-size > 1 (SGLang's names)."""
        dp = f"DP{self.dp_rank}_" if self.dp_rank is not None else ""
        return f"scheduler_{dp}TP{self.tp_rank}"

    @property
    def is_first(self) -> bool:
        """Rank 0 of replica 0 (or of the only TP group): it reports the capacities and
        carries the forward stamp that /health reads."""
        return self.tp_rank == 0 and not self.dp_rank


def ranks_per_node(server_args: ServerArgs) -> int:
    return server_args.tp_size // server_args.nnodes


def local_scheduler_ranks(server_args: ServerArgs) -> list[SchedulerRank]:
    """The scheduler ranks this node (`--node-rank`) starts, replica by replica."""
    per_node = ranks_per_node(server_args)
    first = server_args.node_rank * per_node
    dp_ranks = [None] if server_args.dp_size == 1 else list(range(server_args.dp_size))
    return [SchedulerRank(tp, dp) for dp in dp_ranks for tp in range(first, first + per_node)]


def init_method(server_args: ServerArgs, ipc_dir: str, dp_rank: int | None) -> str:
    """The `init_method` of the TP group of replica `dp_rank`."""
    if server_args.nnodes > 1:
        return f"tcp://{server_args.dist_init_addr}"
    suffix = f"-dp{dp_rank}" if dp_rank is not None else ""
    return f"file://{os.path.join(ipc_dir, RENDEZVOUS_FILE + suffix)}"


def gpu_id(server_args: ServerArgs, rank: SchedulerRank) -> int:
    """The CUDA device of `rank` on its node: `--base-gpu-id`, then one per local rank."""
    per_node = ranks_per_node(server_args)
    return server_args.base_gpu_id + (rank.dp_rank or 0) * per_node + rank.tp_rank % per_node


def describe_other_nodes(server_args: ServerArgs) -> str:
    """Which TP ranks run on the other nodes, for a log line about a lost peer
    (`node 1: TP1`); '' on one node."""
    per_node = ranks_per_node(server_args)
    nodes = [n for n in range(server_args.nnodes) if n != server_args.node_rank]
    return ", ".join(f"node {n}: " + " ".join(f"TP{r}" for r in range(n * per_node, (n + 1) * per_node)) for n in nodes)
