"""Tensor parallelism on torch.distributed: the process groups of one TP group
(parallel_state.py) and the collectives the parallel layers call (communication_op.py)."""

from tandem.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_gather_object,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_min,
)
from tandem.distributed.parallel_state import TpGroup, init_tp_group, is_peer_failure

__all__ = [
    "TpGroup",
    "init_tp_group",
    "is_peer_failure",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_gather_object",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_min",
]
