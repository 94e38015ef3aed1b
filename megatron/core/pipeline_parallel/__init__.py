"""Pipeline parallelism: point-to-point exchange between stages and the 1F1B schedules."""

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    MicroBatchLosses,
    forward_backward_no_pipelining,
    forward_backward_pipelining_with_interleaving,
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
    pipeline_order,
)

__all__ = [
    "MicroBatchLosses", "P2PCommunicator", "forward_backward_no_pipelining",
    "forward_backward_pipelining_with_interleaving",
    "forward_backward_pipelining_without_interleaving", "get_forward_backward_func",
    "pipeline_order",
]
