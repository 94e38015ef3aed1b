"""Data-parallel gradient handling: contiguous grad buffers, bucketed (optionally overlapped)
all-reduce, fully sharded data parallelism on FSDP2, and the gradient finalisation run before each optimizer step."""

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig)
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.distributed.torch_fsdp2 import TorchFullyShardedDataParallel
from megatron.core.distributed.grad_buffer import (Bucket, BufferLayout, GradBuffer,
                                                    compute_buffer_layout)

__all__ = ["Bucket", "BufferLayout", "DistributedDataParallel", "DistributedDataParallelConfig",
           "GradBuffer", "TorchFullyShardedDataParallel", "compute_buffer_layout",
           "finalize_model_grads"]
